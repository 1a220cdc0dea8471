"""What a training step really costs: its peak on real tensors (`peak`) and the exact replay of a
rewritten step on fake tensors (`replay`). Imports only the planner: the step's rules are
planner.step.fake's (`training_loss`), and a real step is undone by planner.step.state's `step_preserved`
(exported here as `preserved`)."""
from remat.planner.step.state import step_preserved as preserved
from remat.planner.step.fake import training_loss

from .peak import allocator_peak, peak_memory
from .replay import dry_run_peak

__all__ = ["peak_memory", "allocator_peak", "preserved", "dry_run_peak", "training_loss"]
