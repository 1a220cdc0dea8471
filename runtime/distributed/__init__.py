"""Plans for data-parallel models: a model sharded with FSDP2 `fully_shard`, or wrapped in DDP.

The step is planned per rank (planner/distributed.py, NOTE [ per-rank memory ]) on one process's
view: the unsharded model on the local batch, profiled on fake tensors. Regions are rewritten
*inside* the engine's modules, so its hooks fire as without remat:
- FSDP2: each fully_shard unit below the root keeps its pre/post-forward hooks (all-gather,
  reshard, the pre-backward all-gather registered on its outputs); its `forward` runs the unit's
  own rewritten graph, whose regions recompute during the unit's backward, when FSDP2 has
  gathered its parameters again. Regions never span two units, nor run in the root's own forward.
- DDP: `module.forward` runs the rewritten graph; DDP's forward and its reducer are untouched.
Every rank runs the same plan: it is solved on rank 0 and broadcast.

The parts: `fsdp` (the engine, what a rank holds, a plain copy: every private FSDP2 access),
`units` (the graph each unit runs), `plan` (solve, agree, install), `job` (a job of any size
planned from one process).
"""
from .fsdp import engine, fsdp_sharding, plain_copy, unit_sizes
from .job import blocks_of, fake_world, per_rank_analysis, shard_per_block
from .plan import DistributedRemat, plan_step, wrap, wrap_model
from .units import GraphForward, KeywordForward, local_regions, unit_calls

__all__ = ["DistributedRemat", "GraphForward", "KeywordForward", "blocks_of", "engine", "fake_world", "fsdp_sharding",
           "local_regions", "per_rank_analysis", "plain_copy", "plan_step", "shard_per_block", "unit_calls",
           "unit_sizes", "wrap", "wrap_model"]
