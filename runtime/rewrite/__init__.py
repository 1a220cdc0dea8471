"""How a plan becomes a model: checkpointed sub-graphs of the traced graph (`graph`), the same
compiled (`compiled`), and checkpointed submodule calls for models no tracer captures
(`module_tree`)."""
from .compiled import CompiledReplay
from .graph import CheckpointRegion, adopt, rewinding, rewrite, rewrite_plan, view_replay
from .module_tree import checkpointing, plan_modules

__all__ = ["rewrite", "rewrite_plan", "CheckpointRegion", "adopt", "rewinding", "view_replay", "CompiledReplay",
           "checkpointing", "plan_modules"]
