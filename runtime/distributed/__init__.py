"""Plans for data-parallel models: a model sharded with FSDP2 `fully_shard`, or wrapped in DDP.

The step is planned per rank (planner/distributed.py, NOTE [ per-rank memory ]) on one process's
view: the unsharded model on the local batch, profiled on fake tensors. Regions are rewritten
*inside* the engine's modules, so its hooks fire as without remat:
- FSDP2: the whole graph is split at the fully_shard units (units.py, NOTE [ the root's graph ]):
  the root's `forward` runs the root's part, which calls each unit (its pre/post-forward hooks,
  all-gather, reshard, the pre-backward all-gather registered on its outputs, run as ever), whose
  `forward` runs its span of the graph; a region recomputes in the part it lies in, during its
  backward, when FSDP2 has that unit's (or the root's) parameters gathered. Regions never span
  two units.
- DDP: `module.forward` runs the rewritten graph; DDP's forward and its reducer are untouched.
Every rank runs the same plan: it is solved on rank 0 and broadcast.

The parts: `fsdp` (the engine, what a rank holds, a plain copy: every private FSDP2 access),
`units` (the graph each unit runs), `plan` (solve, agree, install), `job` (a job of any size
planned from one process). Pipeline stages: `pipeline` (a rank's whole schedule.step),
`interleaved` (a rank of several stages), `pipeline_fsdp` (a stage under FSDP2), `pipeline_job`
(a whole pipeline job from one process).
"""
from .fsdp import engine, fsdp_sharding, plain_copy, unit_sizes
from .job import blocks_of, fake_world, per_rank_analysis, shard_per_block
from .plan import DistributedRemat, plan_step, wrap, wrap_model
from .units import GraphForward, SpanForward, install, region_count, split

__all__ = ["DistributedRemat", "GraphForward", "SpanForward", "blocks_of", "engine", "fake_world", "fsdp_sharding",
           "install", "per_rank_analysis", "plain_copy", "plan_step", "region_count", "shard_per_block", "split",
           "unit_sizes", "wrap", "wrap_model"]
