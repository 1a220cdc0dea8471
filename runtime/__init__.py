"""remat's runtime: rewrite a model by its Plan, measure real peaks, and the user-facing API."""
from .api import RematModule, apply, plan_and_wrap
from .measure import peak_memory
from .rewrite import CheckpointRegion, rewrite

__all__ = ["plan_and_wrap", "apply", "RematModule", "peak_memory", "rewrite", "CheckpointRegion"]
