"""What a training step really costs: its peak on real tensors (`peak`) and the exact replay of a
rewritten step on fake tensors (`replay`). Imports only the planner."""
from .peak import allocator_peak, peak_memory, preserved
from .replay import dry_run_peak, training_loss

__all__ = ["peak_memory", "allocator_peak", "preserved", "dry_run_peak", "training_loss"]
