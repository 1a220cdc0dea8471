"""How a plan becomes a model: checkpointed sub-graphs of the traced graph (`graph`), the same
compiled (`compiled`), checkpointed submodule calls for models no tracer captures
(`module_tree`), and what a region costs on the device (`overhead`)."""
from .compiled import CompiledReplay
from .graph import CheckpointRegion, RecomputeTimes, adopt, regions_of, rewinding, rewrite, rewrite_plan, view_replay
from .module_tree import checkpointing, plan_modules
from .overhead import REGION_PROBE

__all__ = ["rewrite", "rewrite_plan", "CheckpointRegion", "RecomputeTimes", "regions_of", "adopt", "rewinding",
           "view_replay", "CompiledReplay", "checkpointing", "plan_modules", "REGION_PROBE"]
