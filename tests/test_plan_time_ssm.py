"""A state-space model planned cold (issue 42, item 6): a 2-layer Hugging Face Mamba2, random weights.

The plan trains bitwise like the unwrapped model, fits, and predicts its measured peak. Its time is
benchmarks/plan_time_ssm.py's (benchmarks/results/plan-time-ssm.md), never a test's verdict; the
proxy of the work asserted here: the exact front DP (planner/solve/front.py) of a Mamba2 block stays
within FRONT_WORK (before its dominance across states it carried 2.1 M entries, gave up, and 9
segment ILPs of ~12 s each searched the front instead), and so does the lower DP
(planner/solve/lower.py) at the top of that front (before its dominance across states it gave up
there: the segment ILP with a bound on its peak, CBC, answered instead)."""
import copy
import importlib.util

import pytest
import torch

from remat.planner import PlanOptions
from remat.planner.api import analyze_for
from remat.planner.solve.front import front
from remat.planner.solve.hierarchy import for_graph
from remat.planner.solve.improve import search
from remat.planner.solve.lower import cheapest_under
from remat.planner.solve.simulate import timeline
from remat.runtime import plan_and_wrap
from remat.runtime.examples import Example
from remat.runtime.measure import peak_memory, preserved

from helpers import max_diff, planned_step, step

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")]


def mamba2(seed: int = 0) -> Example:
    from transformers import Mamba2Config, Mamba2ForCausalLM
    torch.manual_seed(seed)
    cfg = Mamba2Config(vocab_size=128, hidden_size=128, expand=2, num_heads=8, head_dim=32, n_groups=1,
                       state_size=32, conv_kernel=4, chunk_size=32, num_hidden_layers=2, use_cache=False)
    ids = torch.randint(128, (2, 64))
    return Example(Mamba2ForCausalLM(cfg), (), lambda out: out.loss, dict(input_ids=ids, labels=ids))


def test_mamba2_plans_cold_trains_bitwise_and_predicts_its_peak(monkeypatch):
    monkeypatch.setenv("REMAT_CACHE", "0")
    ex = mamba2()
    ref = copy.deepcopy(ex.model)
    wrapped = plan_and_wrap(ex.model, "65%", example_kwargs=ex.kwargs, loss_fn=ex.loss_fn)
    plan = wrapped.remat.plan
    assert plan.regions
    with preserved(wrapped):
        ref_out, ref_rng = step(ref, ex)
        out, rng = step(wrapped, ex)
        grads = [(p.grad, q.grad) for p, q in zip(ref.parameters(), wrapped.parameters())]
        assert all(g is not None and h is not None for g, h in grads)
        diff = max(max_diff(ref_out, out), max_diff(*zip(*grads)))
        for p in wrapped.parameters():
            p.grad = None
        measured = peak_memory(lambda: planned_step(wrapped, ex), wrapped, ex.inputs, ex.kwargs)
    assert diff == 0.0 and torch.equal(ref_rng, rng)
    assert measured <= plan.budget_bytes
    assert measured <= plan.predicted_peak_bytes <= 1.05 * measured


def test_a_mamba2_blocks_front_is_made_by_the_dp():
    """At fixed sizes the two blocks are one family (with dynamic sizes export computes the first
    block's symbolic sizes once, so the blocks differ): the hierarchical solver's path, whose block
    front the DP makes without a CBC run."""
    ex = mamba2()
    try:
        from remat.planner.capture import trace
        dynamic, trace._dynamic = trace._dynamic, lambda *a: None    # export at the example sizes
        cg = analyze_for(ex.model, (), ex.kwargs, ex.loss_fn, PlanOptions()).cost_graph
    finally:
        trace._dynamic = dynamic
    hier = for_graph(cg, PlanOptions().solve, search(cg))
    assert hier is not None
    block = next(f for f in hier.families if hier.segs[f.members[0]].kind == "block")
    assert len(block.members) == 2 and len(block.ilp.cands) > 1000
    assert block.exact is not None and block.exact == front(block.ilp.sub, block.ilp.cands)
    assert block.ilp.prob is None            # its SegmentILP never built: no CBC run for its front
    # the cheapest plan keeping no more than the front's top at a lower peak (`_Family.lower`'s question)
    top, sub = block.exact[-1], block.rep.sub
    cap, level = timeline(sub, top.plan).peak_bytes - 1, top.kept_mb + block.ilp.tol
    lower = cheapest_under(sub, block.ilp.cands, level, cap)      # raises TooMuchWork past FRONT_WORK
    assert lower is not None and lower.kept_mb <= level and timeline(sub, lower.plan).peak_bytes <= cap
