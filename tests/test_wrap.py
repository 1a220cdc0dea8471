"""plan_and_wrap end to end on the built-in models: fits, predicted >= measured (within 5%),
and trains exactly like the original."""
import pytest
import torch

from planner.baselines import every_block
from planner.simulate import timeline
from runtime import peak_memory, plan_and_wrap

from conftest import FAST, train_step

MODELS = ["gpt2", "mlp", "resnet", "unet"]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.7])
def test_fits_and_trains_identically(case, name, fraction):
    c = case(name)
    ex = c.example
    budget = c.budget(fraction)
    ref, model = c.fresh()
    wrapped = plan_and_wrap(model, budget / 1e9, example_inputs=ex.inputs, loss_fn=ex.loss_fn, options=FAST)
    plan = wrapped.plan
    assert plan.regions, "a budget below the unplanned peak needs checkpointing"
    assert plan.predicted_peak_bytes <= budget

    out_ref, loss_ref = train_step(ref, ex)
    rng_ref = torch.get_rng_state()
    result = {}
    measured = peak_memory(lambda: result.update(zip(("out", "loss"), train_step(wrapped, ex))), model, *ex.inputs)
    assert torch.equal(torch.get_rng_state(), rng_ref), "recompute must not advance the RNG"

    assert measured <= budget, f"measured {measured} > budget {budget}"
    assert plan.predicted_peak_bytes >= measured
    assert plan.predicted_peak_bytes <= 1.05 * measured
    torch.testing.assert_close(result["out"], out_ref)
    torch.testing.assert_close(result["loss"], loss_ref)
    for (n, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=lambda m: f"grad of {n}: {m}")
    for (n, b_ref), b in zip(ref.named_buffers(), model.buffers()):
        torch.testing.assert_close(b, b_ref, msg=lambda m: f"buffer {n}: {m}")


@pytest.mark.parametrize("name", ["gpt2", "resnet", "unet", "mlp"])
def test_never_more_recompute_than_every_block(case, name):
    """At the peak that checkpointing every block reaches, our plan recomputes no more FLOPs."""
    c = case(name)
    cg = c.analysis.cost_graph
    blocks = every_block(cg)
    assert blocks, f"{name} has repeated blocks"
    tl = timeline(cg, blocks)
    from planner import solve_plan
    ours = solve_plan(cg, int(tl.peak_bytes * 1.01) + 1, FAST)
    assert ours.recompute_flops <= tl.recompute_flops


def test_budget_above_unplanned_peak_means_no_regions(case):
    c = case("gpt2")
    ref, model = c.fresh()
    wrapped = plan_and_wrap(model, c.unplanned * 1.5 / 1e9, example_inputs=c.example.inputs,
                            loss_fn=c.example.loss_fn, options=FAST)
    assert wrapped.plan.regions == ()
    assert wrapped.plan.solver == "none"
    gm = wrapped._plans[wrapped._last][1]
    assert not [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("remat_region")]
    out_ref, _ = train_step(ref, c.example)
    out, _ = train_step(wrapped, c.example)
    torch.testing.assert_close(out, out_ref)
