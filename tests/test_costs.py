"""Measured costs (planner/profile/costs.py) and the closed loop (runtime/measure/timing.py): which cost
model a plan is made with and says it was, the cache that makes measured plans repeatable, and
timing that leaves the model as it was. No assertion depends on how fast anything ran."""
import collections
import copy
import dataclasses
import json
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat.planner import PlanOptions, SolveOptions, analyze, plan
from remat.planner.profile.costs import (OVERHEADS, CostModelError, OpCall, OverheadProbe, Overheads, TensorSpec, cache_path,
                           cost_model_for, measured_costs, time_ops)
from remat.planner.profile.rates import DeviceRates
from remat.planner.result import Plan, Region
from remat.planner.solve.simulate import region_recompute
from remat.runtime import examples, plan_and_wrap
from remat.runtime.cli.main import main
from remat.runtime.rewrite import REGION_PROBE, RecomputeTimes, regions_of, rewrite

FAST = PlanOptions(solve=SolveOptions(time_limit_s=4.0))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    return tmp_path


def small_mlp():
    return examples.mlp(depth=4, width=64, batch=32, in_features=32)


def test_auto_is_the_roofline_off_cuda_and_measured_needs_a_real_device():
    assert cost_model_for("auto", torch.device("cpu")) == "roofline"
    assert cost_model_for("auto", torch.device("meta")) == "roofline"
    assert cost_model_for("measured", torch.device("cpu")) == "measured"
    with pytest.raises(CostModelError, match="cost_model='roofline'"):
        cost_model_for("measured", torch.device("meta"))
    with pytest.raises(ValueError, match="auto, measured, roofline"):
        cost_model_for("timed", torch.device("cpu"))


def test_a_meta_model_cannot_be_planned_with_measured_costs():
    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
        x = torch.randn(4, 8)
    with pytest.raises(CostModelError, match="model is on meta"):
        analyze(m, (x,), cost_model="measured")
    assert analyze(m, (x,)).cost_graph.meta["cost_model"] == "roofline"


def test_a_spec_makes_a_real_tensor_of_the_same_layout():
    t = torch.randn(6, 4)[1:].t()             # strided, offset, non-contiguous
    spec = TensorSpec.of(t)
    real = spec.real(grad=True)
    assert (real.shape, real.stride(), real.storage_offset(), real.dtype) == (t.shape, t.stride(), 4, t.dtype)
    idx = TensorSpec.of(torch.tensor([3, 1])).real(grad=True)
    assert idx.dtype == torch.int64 and not idx.any() and not idx.requires_grad    # indices: zero, always valid


def test_an_op_that_cannot_run_on_made_up_values_is_not_timed():
    spd = OpCall.of(torch.ops.aten.cholesky.default, (-torch.eye(64),), {})   # made-up values: never definite
    mm = OpCall.of(torch.ops.aten.mm.default, (torch.randn(3, 3), torch.randn(3, 3)), {})
    fails, works = time_ops([spd, mm], "cpu", rounds=2)
    assert fails is None and works > 0


def test_measured_costs_come_from_the_cache_the_second_time(cache_dir):
    ex = small_mlp()
    first = analyze(ex.model, ex.inputs, None, ex.loss_fn, cost_model="measured", overheads=REGION_PROBE).cost_graph
    costs = first.meta["costs"]
    assert first.meta["cost_model"] == "measured" and costs["timed"] == costs["signatures"] > 0
    assert costs["untimed_nodes"] == 0 and costs["overheads"] == f"measured: {REGION_PROBE.name}"
    path = cache_path(torch.device("cpu"))
    assert path.parent == cache_dir and len(json.loads(path.read_text())["ops"]) == costs["signatures"]
    second = analyze(ex.model, ex.inputs, None, ex.loss_fn, cost_model="measured", overheads=REGION_PROBE).cost_graph
    assert second.meta["costs"]["timed"] == 0               # nothing timed again: the same plan inputs
    assert [c.cost_s for c in second.nodes] == [c.cost_s for c in first.nodes]
    assert (second.region_s, second.sac_op_s) == (first.region_s, first.sac_op_s)
    cached = json.loads(path.read_text())
    assert (first.region_s, first.sac_op_s) == (cached[OVERHEADS]["region_s"], cached[OVERHEADS]["sac_op_s"])
    roofline = analyze(ex.model, ex.inputs, None, ex.loss_fn, cost_model="roofline").cost_graph
    assert "costs" not in roofline.meta and [c.flops for c in roofline.nodes] == [c.flops for c in first.nodes]


def test_the_overheads_are_the_probes_measured_once_else_the_rates_constants(cache_dir):
    """A probe's overheads are measured once per device and cached with its name; another probe
    measures again; without one, DeviceRates' constants (the op timings are cached either way)."""
    calls = [[OpCall.of(torch.ops.aten.relu.default, (torch.randn(8),), {})]]
    runs = []

    def fake(n):
        def measure(device):
            runs.append((n, device))
            return Overheads(region_s=n * 1.0, saved_tensor_s=n * 2.0, sac_op_s=n * 3.0)
        return OverheadProbe(f"fake {n}", measure)
    one, two = fake(1), fake(2)
    m = measured_costs(calls, torch.device("cpu"), one)
    assert (m.region_s, m.saved_tensor_s, m.sac_op_s) == (1.0, 2.0, 3.0) and m.meta["overheads"] == "measured: fake 1"
    assert measured_costs(calls, torch.device("cpu"), one).region_s == 1.0 and runs == [(1, "cpu")]
    assert measured_costs(calls, torch.device("cpu"), two).sac_op_s == 6.0 and runs == [(1, "cpu"), (2, "cpu")]
    rates = DeviceRates.for_device("cpu")
    m = measured_costs(calls, torch.device("cpu"))
    assert (m.region_s, m.saved_tensor_s, m.sac_op_s) == (rates.region_s, rates.saved_tensor_s, rates.sac_op_s)
    assert m.meta["overheads"] == "DeviceRates constants" and m.meta["timed"] == 0 and len(runs) == 2


def test_the_runtime_plans_with_its_own_regions_overheads(cache_dir):
    ex = small_mlp()
    w = plan_and_wrap(ex.model, "90%", example_inputs=ex.inputs, loss_fn=ex.loss_fn,
                      options=PlanOptions(solve=FAST.solve, cost_model="measured"))
    cached = json.loads(cache_path(torch.device("cpu")).read_text())[OVERHEADS]
    assert cached["probe"] == REGION_PROBE.name and w.remat.plan.meta["costs"]["overheads"] == f"measured: {REGION_PROBE.name}"
    assert all(cached[k] >= 0 for k in ("region_s", "saved_tensor_s", "sac_op_s"))


def test_a_region_recompute_formats_no_traceback(monkeypatch):
    """checkpoint stops a recompute early by raising through the region's sub-graph; calling a
    GraphModule would format that exception's traceback (0.25 ms a region on CPU): the region
    calls its forward."""
    ex = small_mlp()
    w = plan_and_wrap(ex.model, "90%", example_inputs=ex.inputs, loss_fn=ex.loss_fn, options=FAST)
    assert len(w.remat.plan.regions) >= 1
    extracted = []
    real = traceback.StackSummary.extract
    monkeypatch.setattr(traceback.StackSummary, "extract", lambda *a, **k: extracted.append(1) or real(*a, **k))
    ex.loss_fn(w(*ex.inputs)).backward()
    assert extracted == [] and all(p.grad is not None for p in ex.model.parameters())


def test_a_node_with_an_untimed_op_keeps_its_roofline(cache_dir):
    calls = [[OpCall.of(torch.ops.aten.cholesky.default, (-torch.eye(64),), {})],
             [OpCall.of(torch.ops.aten.relu.default, (torch.randn(8),), {})], [], None]
    m = measured_costs(calls, torch.device("cpu"))
    assert m.node_s[0] is None and m.node_s[1] > 0 and m.node_s[2] is None and m.node_s[3] is None
    assert m.meta["untimed_nodes"] == 1


def test_the_plan_says_which_cost_model_made_it(cache_dir):
    ex = small_mlp()
    for model in ("roofline", "measured"):
        p = plan(ex.model, "90%", example_inputs=ex.inputs, loss_fn=ex.loss_fn,
                 options=PlanOptions(solve=FAST.solve, cost_model=model))
        assert p.cost_model == model and f"({model} costs)" in p.summary()
        assert Plan.from_json(p.to_json()).cost_model == model


def test_timing_a_plan_leaves_the_model_as_it_was_and_reports_both_overheads():
    ex = examples.resnet(blocks=(1, 1), width=8, image=16, batch=4)    # BatchNorm: buffers a step writes
    ref, model = copy.deepcopy(ex.model), copy.deepcopy(ex.model)
    w = plan_and_wrap(model, "90%", example_inputs=ex.inputs, loss_fn=ex.loss_fn, options=FAST, time=True)
    t = w.remat.plan.meta["timing"]
    assert t["rounds"] == 7 and t["ratio_low"] <= t["ratio"] <= t["ratio_high"] and t["unplanned_s"] > 0
    assert t["predicted_extra_s"] == w.remat.plan.recompute_s and t["cost_model"] == "roofline"
    assert "timed: step" in w.remat.plan.summary() and "predicted" in t["text"]
    assert all(p.grad is None for p in model.parameters())
    for a, b in zip(ref.buffers(), model.buffers()):
        assert torch.equal(a, b)                          # running statistics untouched by the timed steps
    torch.manual_seed(0)
    ex.loss_fn(ref(*ex.inputs)).backward()
    torch.manual_seed(0)
    ex.loss_fn(w(*ex.inputs)).backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert w.remat.plan_for(*ex.inputs).meta["timing"] == t      # the timed plan is the one cached


def test_time_needs_example_inputs():
    ex = small_mlp()
    with pytest.raises(ValueError, match="pass example_inputs"):
        plan_and_wrap(ex.model, "70%", time=True)


SMALL = """import torch
def make():
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4)])
    return m, (torch.randn(512, 64),)
"""


def test_the_cli_report_times_the_plan_and_names_the_cost_model(capsys, cache_dir):
    (cache_dir / "small.py").write_text(SMALL)
    assert main(["report", f"{cache_dir / 'small.py'}:make", "--budget", "90%", "--time", "--costs", "measured",
                 "--quiet", "--time-limit", "4"]) == 0
    out = capsys.readouterr().out
    assert "(measured costs)" in out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("time ")]
    assert "unplanned" in line and "predicted" in line and "measured" in line
    (header,) = [ln for ln in out.splitlines() if ln.startswith("#  ")]
    assert "est ms  meas ms" in header and "meas ms: its recompute in backward" in out


def test_recompute_times_records_each_regions_recompute_only_while_on():
    ex = small_mlp()
    a = analyze(ex.model, ex.inputs, None, ex.loss_fn)
    regions = (Region(0, 4), Region(5, 9))
    gm = rewrite(ex.model, a.traced.gm, regions, tuple(c.name for c in a.cost_graph.nodes))
    ref = copy.deepcopy(ex.model)
    with RecomputeTimes(gm) as times:
        for _ in range(3):
            ex.loss_fn(gm(**a.example_inputs)).backward()
    assert [len(c.seconds()) for c in times.clocks] == [3, 3]          # one recompute per region and step
    assert all(t > 0 for t in times.fastest())
    assert all(r.clock is None for r in regions_of(gm))
    for _ in range(3):
        ex.loss_fn(ref(*ex.inputs)).backward()
    for p, q in zip(ref.parameters(), ex.model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)     # timing changes nothing


def test_a_node_costs_its_ops_plus_the_hooks_on_what_it_saves(cache_dir):
    """With the cache rewritten to known numbers (every op 1 ms, a saved tensor 1 s), a node
    costs its ops' times plus one second per tensor its autograd saves: Linear on an input that
    needs no gradient saves only that input (for its weight's gradient), GELU its input, a
    residual add nothing."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.nn.functional.gelu(self.lin(x)) + x
    m, x = M(), torch.randn(4, 8)
    probe = OverheadProbe("known", lambda device: Overheads(region_s=0.0, saved_tensor_s=1.0, sac_op_s=0.0))
    first = analyze(m, (x,), cost_model="measured", overheads=probe).cost_graph
    path = cache_path(torch.device("cpu"))
    cache = json.loads(path.read_text())
    cache["ops"] = {k: 1e-3 for k in cache["ops"]}
    path.write_text(json.dumps(cache))
    cg = analyze(m, (x,), cost_model="measured", overheads=probe).cost_graph
    assert cg.meta["costs"]["timed"] == 0 and [c.ops for c in cg.nodes] == [c.ops for c in first.nodes]
    saved = {c.target: round(c.cost_s - c.ops * 1e-3, 9) for c in cg.nodes[:-1]}
    assert saved == {"Linear(lin)": 1.0, "gelu": 1.0, "add": 0.0}


def test_timing_a_model_in_eval_mode_times_its_training_step_and_leaves_it_in_eval():
    ex = examples.resnet(blocks=(1,), width=8, image=16, batch=4)
    model = copy.deepcopy(ex.model).eval()
    w = plan_and_wrap(model, "90%", example_inputs=ex.inputs, loss_fn=ex.loss_fn, options=FAST, time=True)
    assert w.remat.plan.regions and w.remat.plan.meta["timing"]["rounds"] == 7
    assert not w.training and not any(m.training for m in model.modules())
    assert len(w.remat.plans) == 1          # timing planned nothing more: it ran in the modes planned for


def test_the_cli_times_eager_steps_only(capsys):
    assert main(["report", "mlp", "--budget", "70%", "--time", "--compile"]) == 2
    assert "drop --compile" in capsys.readouterr().err


def test_the_recompute_runs_the_nodes_the_cost_model_charges():
    """checkpoint stops a recompute as the region's last saved tensor is packed again, and an op
    packs its inputs before it computes, its outputs after: a last holder that saves only its
    input (a Linear, a GELU) never computes, one that saves what it makes (a LayerNorm: its mean
    and rstd) does. The forward ops that run while backward recomputes are those of the nodes
    planner.solve.simulate.region_recompute charges (decoded from its seconds: node j costs 2^j)."""
    ex = small_mlp()
    a = analyze(ex.model, ex.inputs, None, ex.loss_fn)
    cg = a.cost_graph
    regions = (Region(0, 4), Region(5, 9), Region(10, 12))      # ending at a LayerNorm, a Linear, a Linear
    gm = rewrite(ex.model, a.traced.gm, regions, tuple(c.name for c in cg.nodes))
    coded = dataclasses.replace(cg, region_s=0.0, nodes=tuple(dataclasses.replace(c, cost_s=2.0 ** j)
                                                              for j, c in enumerate(cg.nodes)))
    charged = [j for r in regions for j in r_nodes(coded, r)]
    kinds = {"Linear": "addmm", "LayerNorm": "native_layer_norm", "GELU": "gelu"}
    expected = collections.Counter(kinds[cg.nodes[j].target.split("(")[0]] for j in charged)

    class Ran(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))
    out = gm(**a.example_inputs)
    with Ran() as ran:
        ex.loss_fn(out).backward()
    assert {k: ran.ops[k] for k in kinds.values()} == {k: expected[k] for k in kinds.values()}
    assert 4 in charged and 9 not in charged and 12 not in charged and expected["addmm"] == 3


def r_nodes(coded, r) -> list[int]:
    """The nodes a region's recompute is charged for, read off its seconds (node j costs 2^j)."""
    secs = round(region_recompute(coded, r).seconds)
    return [j for j in range(len(coded.nodes)) if secs >> j & 1]
