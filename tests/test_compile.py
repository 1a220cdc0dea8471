"""plan_and_wrap(..., compile=True): the rewritten graph compiles whole, trains like the original,
and its measured compiled peak is within the budget."""
import copy

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters

from remat.runtime import examples
from remat.runtime.api import plan_and_wrap
from remat.runtime.measure import peak_memory

from helpers import FAST, ctc_loss

pytestmark = [pytest.mark.slow, pytest.mark.compile]


# the ResNet of tests/test_compiled_memory.py (BatchNorm and convolutions: the harder compiled
# case), small: a compile's C++ kernels are most of a test's time
SMALL = dict(blocks=(1, 1), width=16, image=16, batch=4)


def _compiled(budget):
    ex = examples.resnet(**SMALL)
    ref, model = copy.deepcopy(ex.model), copy.deepcopy(ex.model)
    torch._dynamo.reset()
    counters.clear()
    wrapped = plan_and_wrap(model, budget, example_inputs=ex.inputs, loss_fn=ex.loss_fn, options=FAST, compile=True)
    return ex, ref, model, wrapped


def _step(m, ex):
    torch.manual_seed(1)
    loss = ex.loss_fn(m(*ex.inputs))
    loss.backward()
    return loss.detach()


def _error(loss, model, loss64, ref64) -> float:
    """Largest relative difference to the float64 step: of the loss, and of each grad (to its max)."""
    errs = [abs(loss.double() - loss64).item() / abs(loss64.item())]
    errs += [((p.grad.double() - q.grad).abs().max() / q.grad.abs().max()).item()
             for p, q in zip(model.parameters(), ref64.parameters())]
    return max(errs)


# the built-in models compiled: benchmarks/compile.py
@inductor_config.patch(fallback_random=True)        # dropout draws eager's masks, to compare with eager
def test_compiled_plan_fits_and_trains_like_the_original():
    ex, ref, model, wrapped = _compiled("90%")      # of the compiled unplanned step (its floor: 84%)
    plan = wrapped.remat.plan
    budget = plan.budget_bytes
    assert plan.regions and plan.predicted_peak_bytes <= budget
    assert "compiled step" in " ".join(plan.notes)
    # no graph breaks: the traced graph compiles whole (no Dynamo capture of it), its regions in
    assert not counters["graph_break"]
    # compiled float32 arithmetic is not eager's: both are compared with the float64 eager step,
    # and the compiled one must be as close as eager float32 is (a wrong dropout mask or a
    # BatchNorm statistic updated twice is off by orders of magnitude more)
    ref64 = copy.deepcopy(ref).double()
    ex64 = ex._replace(inputs=tuple(x.double() if x.is_floating_point() else x for x in ex.inputs))
    loss64 = _step(ref64, ex64)
    compiled, eager = (_error(_step(m, ex), m, loss64, ref64) for m in (wrapped, ref))
    assert compiled <= 2 * eager + 1e-5, (compiled, eager)
    for b, r in zip(model.buffers(), ref.buffers()):
        torch.testing.assert_close(b, r)
    model.zero_grad(set_to_none=True)
    measured = peak_memory(lambda: _step(wrapped, ex), model, *ex.inputs, allocator=True)
    assert measured <= budget


def test_compiled_budget_below_the_compiled_floor_names_it():
    """ResNet's compiled step saves more than its eager one: a budget the eager plan meets can be
    below every compiled plan; the error names the smallest compiled budget, predicted."""
    from remat.planner import InfeasibleBudgetError
    ex = examples.resnet(**SMALL)
    with pytest.raises(InfeasibleBudgetError) as eager:
        plan_and_wrap(ex.model, 1e-9, example_inputs=ex.inputs, loss_fn=ex.loss_fn, options=FAST)
    floor = eager.value.min_feasible_bytes
    assert plan_and_wrap(ex.model, floor / 1e9, example_inputs=ex.inputs, loss_fn=ex.loss_fn, options=FAST).remat.plan
    with pytest.raises(InfeasibleBudgetError) as e:
        _compiled(floor / 1e9)
    assert e.value.min_feasible_bytes > floor


def _checked_plans(monkeypatch) -> list:
    """The plans compile mode checks with Inductor's wrapper (CompiledPrediction.checked), in order."""
    from remat.runtime.rewrite.compiled import CompiledPrediction
    seen, checked = [], CompiledPrediction.checked

    def counted(self, regions):
        if tuple(regions) not in self.checks:
            seen.append(tuple(regions))
        return checked(self, regions)
    monkeypatch.setattr(CompiledPrediction, "checked", counted)
    return seen


def test_a_budget_in_bytes_plans_as_its_share_did_and_checks_no_unplanned_step(monkeypatch):
    """NOTE [ the unplanned check, alongside ]: a '%' budget is a share of the checked unplanned
    step; the same budget in bytes is the same plan, and the unplanned step is not checked for it
    (its peak in the plan is the modelled one, and the notes say so)."""
    seen = _checked_plans(monkeypatch)
    share = _compiled("90%")[3].remat.plan
    assert () in seen and "unplanned peak: modelled" not in " ".join(share.notes)
    seen.clear()
    exact = _compiled(share.budget_bytes / 1e9)[3].remat.plan
    assert exact.budget_bytes == share.budget_bytes
    assert (exact.regions, exact.predicted_peak_bytes) == (share.regions, share.predicted_peak_bytes)
    assert () not in seen and seen[-1] == exact.regions
    assert "unplanned peak: modelled" in " ".join(exact.notes)


def test_the_compiled_fit_solves_without_polish_or_local_search(monkeypatch):
    """NOTE [ the compiled fit ]: each round's plan is judged by the compiled step, so its solves
    run without the flat ILP's polish and without the local search after them (the eager
    simulator's refinements), whatever the options say; an eager plan keeps both."""
    import remat.runtime.planning as planning
    given, solve = [], planning.solve_plan
    monkeypatch.setattr(planning, "solve_plan", lambda cg, b, options, *a, **k: given.append(options.solve)
                        or solve(cg, b, options, *a, **k))
    _compiled("90%")
    assert given and all(not o.polish and o.improve_evals == 0 for o in given)
    given.clear()
    ex = examples.resnet(**SMALL)
    plan_and_wrap(ex.model, "90%", example_inputs=ex.inputs, loss_fn=ex.loss_fn, options=FAST)
    assert given and all(o.improve_evals == FAST.solve.improve_evals for o in given)


def test_a_budget_far_below_the_compiled_floor_is_refused_after_checking_the_known_plans(monkeypatch):
    """NOTE [ far below the floor ]: a budget far under the least modelled peak is refused after
    checking the plans the modelled floor search measured (no fit with every plan checked), and
    the floor it names (the least checked peak) fits, typed back."""
    from remat.planner import InfeasibleBudgetError
    from remat.planner.workers import cores
    from remat.runtime.rewrite.compiled import CompiledPrediction
    seen = _checked_plans(monkeypatch)
    running, start = [], CompiledPrediction.start      # checks running when each is started

    def started(self, regions, alongside=True):
        start(self, regions, alongside)
        running.append(len([r for r in self.started if r]))
    monkeypatch.setattr(CompiledPrediction, "start", started)
    with pytest.raises(InfeasibleBudgetError) as e:
        _compiled(1e-6)
    floors = e.value.floor_plans
    assert sorted(seen) == sorted(r for _, r in floors) and len(seen) == len(set(seen))
    # the floor plans' checks run as many at a time as there are cores (one after another on one)
    assert max(running) == min(max(1, cores()), len(floors))
    assert e.value.min_feasible_bytes == floors[0][0] == min(p for p, _ in floors)
    plan = _compiled(e.value.min_feasible_bytes / 1e9)[3].remat.plan
    assert plan.predicted_peak_bytes <= e.value.min_feasible_bytes


def _signature(gm) -> list[tuple]:
    """A joint graph node by node: op, target, shape, dtype and the traced node it computes."""
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        out.append((n.op, str(n.target), tuple(v.shape) if isinstance(v, torch.Tensor) else None,
                    v.dtype if isinstance(v, torch.Tensor) else None, n.meta.get("custom", {}).get("remat")))
    return out


@inductor_config.patch(fallback_random=True)
def test_the_joint_graph_planned_is_the_one_trained_and_a_tied_weight_trains_like_eager(monkeypatch):
    """NOTE [ one compile, no Dynamo ]: the plan's capture and the training model compile the traced
    graph through one call, so the training compile's partitioner is handed the joint graph the
    plan was made on, node for node. The GPT-2 ties its lm_head to its embedding: the weight is two
    of the compiled step's inputs, and its gradient (both uses') equals eager's."""
    from remat.planner.compiled import joint as joint_module, tags
    ex = examples.gpt2(n_layer=2, d_model=32, n_head=2, seq_len=32, batch=8, vocab=64)
    ref, model = copy.deepcopy(ex.model), copy.deepcopy(ex.model)
    captured, trained = [], []
    keep = joint_module.capture_joint
    monkeypatch.setattr("remat.runtime.rewrite.compiled.capture_joint",
                        lambda *a, **k: captured.append(keep(*a, **k)) or captured[-1])
    partition = tags.Tagged.__call__
    monkeypatch.setattr(tags.Tagged, "__call__", lambda self, gm, *a, **k: trained.append(_signature(gm))
                        or partition(self, gm, *a, **k))
    wrapped = plan_and_wrap(model, "80%", example_inputs=ex.inputs, loss_fn=ex.loss_fn, options=FAST, compile=True)
    assert wrapped.remat.plan.regions
    assert model.lm_head.weight is model.wte.weight
    planned = _signature(captured[0].gm)
    compiled, eager = _step(wrapped, ex), _step(ref, ex)
    assert trained == [planned]
    torch.testing.assert_close(compiled, eager)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name, rtol=1e-4, atol=1e-5)


def test_compile_arguments_become_inductors_config():
    """`compile=` takes torch.compile's keywords: `mode`'s options, then `options`; another backend
    or an argument Inductor's backend has no use for is refused, saying what to do."""
    from remat.planner.compiled.joint import options
    assert options(None) == {}
    assert options({"mode": "max-autotune-no-cudagraphs", "options": {"max_autotune": False}}) == \
        {**torch._inductor.list_mode_options("max-autotune-no-cudagraphs"), "max_autotune": False}
    assert options({"dynamic": False, "fullgraph": True, "backend": "inductor"}) == {}
    with pytest.raises(ValueError, match="drop the backend"):
        options({"backend": "aot_eager"})
    with pytest.raises(ValueError, match="not \\['disable'\\]"):
        options({"disable": True})


class _Scaled(torch.nn.Module):
    """Blocks whose output a float and a flag passed with the input change."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                                torch.nn.Linear(256, 64)) for _ in range(4)])

    def forward(self, x, scale=1.0, twice=False):
        y = self.blocks(x) * scale
        return y * 2 if twice else y


def test_a_compiled_plan_takes_the_calls_other_values_as_constants():
    """NOTE [ one compile, no Dynamo ]: a call's non-tensor inputs are constants of its compiled
    step; a call with other values is planned and compiled as a call of its own, and each trains
    like the original."""
    torch.manual_seed(0)
    model, x = _Scaled(), torch.randn(512, 64)
    ref = copy.deepcopy(model)

    def loss(out):
        return out.square().mean()
    wrapped = plan_and_wrap(model, "70%", example_inputs=(x,), example_kwargs={"scale": 0.5, "twice": True},
                            loss_fn=loss, options=FAST, compile=True)
    assert wrapped.remat.plan.regions
    for kwargs in ({"scale": 0.5, "twice": True}, {"scale": 2.0, "twice": False}):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        got, want = loss(wrapped(x, **kwargs)), loss(ref(x, **kwargs))
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("loss", ["fake", "real"])
def test_the_joint_graph_captured_beside_the_profile_is_the_one_planned(loss, monkeypatch):
    """NOTE [ the profile, beside ]: the joint graph is captured once, while a worker profiles the
    graph, and planned on; with a loss fake tensors cannot run (ctc_loss: the worker's profile
    fails, the loss is measured for real here) that capture is kept too. The plan fits as
    measured, and the compiled model trains like the original."""
    import remat.planner.api as api
    import remat.runtime.rewrite.compiled as rewrite_compiled
    from remat.planner import workers
    monkeypatch.delenv("REMAT_WORKERS", raising=False)
    captured, forked = [], []
    real_capture = rewrite_compiled.capture_joint
    monkeypatch.setattr(rewrite_compiled, "capture_joint", lambda *a: captured.append(a) or real_capture(*a))
    monkeypatch.setattr(api, "started", lambda *a: forked.append(a) or workers.started(*a))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 20))
    ref = copy.deepcopy(model)
    x = torch.randn(8, 100, 16)
    loss_fn = (lambda out: out.square().mean()) if loss == "fake" else ctc_loss
    wrapped = plan_and_wrap(model, "80%", example_inputs=(x,), loss_fn=loss_fn, options=FAST, compile=True)
    plan = wrapped.remat.plan
    assert len(captured) == 1 and len(forked) == 1 and plan.regions
    losses = []
    for m in (wrapped, ref):
        losses.append(loss_fn(m(x)))
        losses[-1].backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5)
    model.zero_grad(set_to_none=True)
    measured = peak_memory(lambda: loss_fn(wrapped(x)).backward(), model, x, allocator=True)
    assert measured <= plan.budget_bytes
