"""Data-parallel steps planned per rank: the memory model on hand-built CostGraphs (no torch), a
64-rank FSDP2 plan from one process (a fake process group), and 2 gloo ranks on CPU training
under FSDP2 and DDP against one process training the plain model on the global batch."""
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from remat.planner import CostGraph, InfeasibleBudgetError, PlanOptions, Region, SolveOptions, solve_plan
from remat.planner.solve.baselines import every_block
from remat.planner.solve.candidates import SearchSpace
from remat.planner.costgraph import NodeCost, StorageCost
from remat.planner.distributed import Sharding, Unit, per_rank, unit_of
from remat.planner.solve.simulate import base_liveness, timeline

MB = 10**6
ROOT = Path(__file__).resolve().parents[1]
FAST = PlanOptions(solve=SolveOptions(time_limit_s=4.0))


def _node(i: int, module: str, grad_mb: int = 0, last: bool = False) -> NodeCost:
    return NodeCost(name="loss" if last else f"n{i}", target="loss" if last else "f", module=module, flops=10,
                    cost_s=1e-6, fwd_extra_bytes=0, bwd_extra_bytes=0, grad_bytes=0, grad_last_user=i,
                    param_grad_bytes=grad_mb * MB, recomputable=not last, why_not="the loss" if last else "")


def two_units(act_mb: int = 4) -> CostGraph:
    """embedding (root) -> 2 nodes in unit a -> 2 in unit b -> loss; node i+1 saves node i's act_mb MB;
    each unit node makes 8 MB of parameter gradients; 32 MB of parameters (16 per unit)."""
    mods = ["", "a", "a.up", "b", "b.up"]
    nodes = [_node(i, m, 8 if m else 0) for i, m in enumerate(mods)] + [_node(5, "", last=True)]
    storages = [StorageCost(act_mb * MB, i, (i + 1,), (i + 1,)) for i in range(5)]
    return CostGraph(nodes=tuple(nodes), storages=tuple(storages), fixed_bytes=40 * MB, param_bytes=32 * MB)


SHARDED = Sharding("fsdp", 2, (Unit("", 0, 0, 0, 0, False), Unit("a", 16 * MB, 8 * MB, 16 * MB, 8 * MB),
                               Unit("b", 16 * MB, 8 * MB, 16 * MB, 8 * MB)))


def test_unit_of_is_the_innermost_unit():
    assert unit_of("layers.1.attn", ("", "layers.1", "layers.10")) == "layers.1"
    assert unit_of("layers.10", ("", "layers.1", "layers.10")) == "layers.10"
    assert unit_of("head", ("", "layers.1")) == ""


def test_per_rank_fsdp_by_hand():
    """NOTE [ per-rank memory ] on two units of 16 MB over 2 ranks, worked by hand."""
    cg = per_rank(two_units(), SHARDED)
    assert cg.fixed_bytes == (40 - 32 + 16) * MB                  # parameters as shards
    assert [c.unit for c in cg.nodes] == ["", "a", "a", "b", "b", ""]
    assert cg.nodes[0].recomputable            # the root's own nodes can be in regions too
    # forward: a unit's parameters while it runs, at its first node the all-gather's flat output
    # (16: the shard is copied into it, no buffer of its own), and the latest all-gather's
    # output, kept until the next all-gather (b's until the root's post-forward frees it: not
    # during the loss)
    assert [c.fwd_held_bytes // MB for c in cg.nodes] == [0, 16 + 16 + 16, 16 + 16, 16 + 16 + 16, 16 + 16, 0]
    # backward (b runs first, a prefetched while it does: a's all-gather output, 16): parameters,
    # at a unit's last node its all-gather's output being copied out (16), its gradients until
    # the reduce-scatter at its first node (8 + 8 at the first node, 8 at the second), whose input
    # is there too (16, less the 8 of shards it makes, counted from there: the gradients are freed
    # before the output is allocated); while a runs, b's reduce-scatter input (16), kept until a's
    # reduce-scatter is issued, and a's while the root's first node runs backward; nothing held
    # during the loss's backward
    assert [c.bwd_held_bytes // MB for c in cg.nodes] == [16, 16 + 16 + 16 + 8, 16 + 16 + 16 + 8,
                                                          16 + 16 + 16 + 8, 16 + 16 + 16 + 8, 0]
    assert [c.param_grad_bytes // MB for c in cg.nodes] == [0, 8, 0, 8, 0, 0]    # shards, at the reduce-scatter


def test_the_roots_last_nodes_hold_the_first_backward_units_all_gather():
    """A head in the root after the last unit: in forward it runs while that unit's all-gather
    output is kept (freed by the root's post-forward, before the loss); in backward, the root's
    pre-backward hook (after the loss's backward) prefetches that unit: its all-gather output is
    in flight while the head runs backward, and nothing is during the loss's."""
    mods = ["", "a", "a.up", ""]
    nodes = [_node(i, m, 8 if m else 0) for i, m in enumerate(mods)] + [_node(4, "", last=True)]
    storages = [StorageCost(4 * MB, i, (i + 1,), (i + 1,)) for i in range(4)]
    cg = per_rank(CostGraph(tuple(nodes), tuple(storages), 24 * MB, 16 * MB),
                  Sharding("fsdp", 2, (Unit("", 0, 0, 0, 0, False), Unit("a", 16 * MB, 8 * MB, 16 * MB, 8 * MB))))
    assert [c.unit for c in cg.nodes] == ["", "a", "a", "", ""]
    assert [c.fwd_held_bytes // MB for c in cg.nodes] == [0, 16 + 16 + 16, 16 + 16, 16, 0]
    assert [c.bwd_held_bytes // MB for c in cg.nodes][3:] == [16, 0]


def test_held_bytes_are_live_while_a_region_recomputes():
    """H_t counts in the recompute's peak too (bwd_extra does not): the unit's gathered
    parameters are there while its region runs again."""
    cg = per_rank(two_units(), SHARDED)
    r = Region(3, 4)
    tl = timeline(cg, (r,))
    base = base_liveness(cg)
    assert tl.bwd[4] >= base.bwd[4] and tl.bwd[4] >= cg.fixed_bytes + cg.nodes[4].bwd_held_bytes + 4 * MB


def test_regions_never_span_two_units():
    """A region lies in one unit, or among the root's own nodes (recomputed while FSDP2 holds the
    root's parameters gathered): never across a unit's boundary."""
    cg = per_rank(two_units(act_mb=40), SHARDED)
    space = SearchSpace(cg)
    assert space.valid(1, 2) and space.valid(3, 4) and space.valid(0, 0)
    assert not space.valid(2, 3) and not space.valid(0, 1)
    with pytest.raises(InfeasibleBudgetError) as e:
        solve_plan(cg, 1, FAST)
    unplanned, floor = timeline(cg, ()).peak_bytes, e.value.min_feasible_bytes
    assert floor < unplanned
    plan = solve_plan(cg, floor, FAST)
    assert plan.regions and all(cg.nodes[r.start].unit == cg.nodes[r.end].unit for r in plan.regions)
    assert all(cg.nodes[r.start].unit == cg.nodes[r.end].unit for r in every_block(cg))


def test_the_graph_split_at_its_units_computes_what_the_model_does():
    """NOTE [ the root's graph ] without a process group: a plain model's graph split at its
    blocks, each block's forward its span (called by the root's graph with remat_span=True, once
    per step, through the module: its hooks run), a region over the root's head; the output and
    every gradient are the model's own, bit for bit."""
    import torch

    from remat.planner import analyze
    from remat.planner.profile.graph import compute_nodes
    from remat.runtime.distributed.units import GraphForward, SpanForward, split
    from remat.runtime.rewrite import regions_of, rewrite
    sys.path.insert(0, str(ROOT / "tests"))
    from distributed_worker import Tiny

    torch.manual_seed(0)
    m, ref = Tiny(), Tiny()
    ref.load_state_dict(m.state_dict())
    x = torch.randint(0, 96, (4, 16))
    a = analyze(m, (x,))
    blocks = tuple(f"layers.{i}" for i in range(len(m.layers)))
    units = [unit_of(c.module, blocks) for c in a.cost_graph.nodes[:-1]]
    root_gm, parts = split(a.traced.gm, units, m)
    assert sorted(parts) == list(blocks)
    calls = []
    for name, part in parts.items():
        block = m.get_submodule(name)
        block.register_forward_pre_hook(lambda mod, args, kw: calls.append(kw), with_kwargs=True)
        names = tuple(n.name for n in compute_nodes(part))
        object.__setattr__(block, "forward", SpanForward(block, rewrite(m, part, (), names), m))
    names = tuple(n.name for n in compute_nodes(root_gm))
    head = names.index(next(n.name for n in compute_nodes(root_gm) if n.target == "head"))
    gm = rewrite(m, root_gm, (Region(head, head),), names)
    object.__setattr__(m, "forward", GraphForward(m, gm, a.traced))
    assert len(regions_of(gm)) == 1
    out = m(x)
    assert calls == [{"remat_span": True}] * len(blocks)
    out.pow(2).mean().backward()
    want = ref(x)
    want.pow(2).mean().backward()
    assert torch.equal(out, want)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters()))
    m.eval()
    assert torch.equal(m(x), ref.eval()(x)) and calls[len(blocks):] == [{}] * len(blocks)   # each its own forward


def test_ddp_holds_its_buckets_throughout():
    cg = per_rank(two_units(), Sharding("ddp", 2, bucket_bytes=32 * MB))
    assert cg.fixed_bytes == 72 * MB and cg.meta["distributed"]["engine"] == "ddp"
    assert timeline(cg, ()).peak_bytes == timeline(two_units(), ()).peak_bytes + 32 * MB


def test_a_unit_that_runs_twice_is_refused():
    cg = two_units()
    nodes = list(cg.nodes)
    nodes[4] = NodeCost(**{**nodes[4].__dict__, "module": "a"})
    with pytest.raises(ValueError, match="runs twice"):
        per_rank(CostGraph(tuple(nodes), cg.storages, cg.fixed_bytes, cg.param_bytes), SHARDED)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Every configuration the 2-rank tests check, run in turn by one launch of 2 gloo ranks (a
# launch, 3 Python processes importing torch and a process group, costs more than a config).
TWO_RANK_CONFIGS = ("fsdp", "fsdp-keep", "ddp", "fsdp-bf16", "infeasible", "gpt", "llama", "gpt2", "gpt2-ddp")


# The ranks' gradients are summed by gloo in another order than one process sums the global batch:
# they differ in the last bits (1e-9 seen), and AdamW divides each step by the root of the squared
# gradients, which amplifies such a difference where a gradient is near zero. The parameters after
# STEPS steps of lr LR may then differ by a small fraction of a step (3e-6 seen under a loaded CI
# run, 1e-6 asked before); a wrong plan moves them by whole steps (~LR each).
LR, STEPS = 1e-2, 3          # tests/distributed_worker.py's AdamW and steps
PARAM_TOLERANCE = 1e-3 * LR * STEPS


def _trains_like_one_process(diff: dict) -> None:
    assert diff["grad"] <= 1e-6 * max(1.0, diff["grad_scale"]), diff
    assert diff["param"] <= PARAM_TOLERANCE, diff


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """config -> its result (tests/distributed_worker.py), from one launch for the module."""
    out = tmp_path_factory.mktemp("two_ranks") / "out.json"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "distributed_worker.py"), ",".join(TWO_RANK_CONFIGS),
                        str(_free_port()), str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    results = json.loads(out.read_text()) if out.exists() else {}

    def get(config: str) -> dict:
        assert config in TWO_RANK_CONFIGS
        res = results.get(config)
        assert res is not None, f"{config} did not run (exit {r.returncode}):\n{r.stderr[-3000:]}"
        assert "error" not in res, f"{config} raised on a rank:\n{res['error'][-3000:]}"
        return res
    return get


@pytest.mark.slow
@pytest.mark.parametrize("config", ["fsdp", "fsdp-keep", "ddp"])
def test_two_gloo_ranks_train_like_one_process_and_fit(config, two_ranks):
    """FSDP2 (per block then root; resharded after forward or not) and DDP, AdamW stepping: the
    full gradients and parameters after three steps equal one process training the plain model
    on the global batch; each rank's measured peak fits the per-rank budget, the prediction at or
    above it, within 5%."""
    res = two_ranks(config)
    _trains_like_one_process(res["diff"])
    for rank in res["ranks"]:
        assert rank["regions"] > 0                       # 80% of the unplanned peak needs regions
        assert rank["measured"] <= rank["predicted"] <= 1.05 * rank["measured"] and rank["measured"] <= rank["budget"]
    assert res["ranks"][0]["predicted"] == res["ranks"][1]["predicted"]     # one plan, broadcast
    if config == "fsdp":
        assert all(rank["resharded_after_forward"] for rank in res["ranks"])


def _report(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "remat", "report", "tests/distributed_worker.py:factory",
                             "--budget", "90%", "--optimizer", "adamw", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_the_cli_plans_a_rank_of_any_world_from_one_process():
    """`remat report MODEL --world-size N --fsdp` on a fake process group: one rank's step, its
    shards and optimizer state shrinking with N; --ddp holds the whole model and its buckets."""
    plans = {}
    runs = {flags: _report(*flags, "--json")          # at once: each pays for importing torch
            for flags in (("--world-size", "2", "--fsdp"), ("--world-size", "64", "--fsdp"), ("--world-size", "2", "--ddp"))}
    try:
        for flags, proc in runs.items():
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-2000:]
            plans[flags] = json.loads(out)["plan"]
    finally:
        for proc in runs.values():
            proc.kill()
            proc.wait()
    two, many, ddp = plans.values()
    assert two["meta"]["distributed"] == {**two["meta"]["distributed"], "engine": "fsdp", "world_size": 2}
    assert many["meta"]["distributed"]["world_size"] == 64
    assert many["unplanned_peak_bytes"] < two["unplanned_peak_bytes"] < ddp["unplanned_peak_bytes"]
    assert many["meta"]["optimizer_state_bytes"] < two["meta"]["optimizer_state_bytes"]
    assert all(p["predicted_peak_bytes"] <= p["budget_bytes"] for p in plans.values())


def test_the_cli_refuses_what_one_process_cannot_do_for_a_job(capsys, monkeypatch):
    """In process (main() returns the exit code `remat` exits with), as tests/test_cli.py's MORE_BAD."""
    from remat.runtime.cli import main
    monkeypatch.chdir(ROOT)
    assert main(["sweep", "tests/distributed_worker.py:factory", "--budgets", "50%..90%", "--world-size", "8",
                 "--fsdp", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "--fsdp and --ddp plan one rank" in err and "Traceback" not in err


@pytest.mark.parametrize("tied", [False, True])
def test_parameters_with_freed_storage_profile_as_the_real_ones(tied):
    """The planning copy's parameters hold no memory (their storage freed, as FSDP2 frees gathered
    ones): the profile sees them at their full size, so it equals the real model's; a tied
    weight (an embedding and its output layer, as GPTs tie them) is counted once."""
    import torch

    from remat.planner import analyze
    from remat.runtime.distributed.fsdp import _empty

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16),
                            torch.nn.Linear(16, 50, bias=False))
    if tied:
        m[4].weight = m[0].weight
    x = torch.randint(0, 50, (4, 8))
    real = analyze(m, (x,)).cost_graph
    freed = {}
    for mod in m.modules():
        for k, p in [(k, p) for k, p in mod._parameters.items() if p is not None]:
            if id(p) not in freed:
                freed[id(p)] = torch.nn.Parameter(_empty(p.shape, p.dtype, p.device))
            mod._parameters[k] = freed[id(p)]
    assert sum(p.untyped_storage().nbytes() for p in m.parameters()) == 0 and (m[4].weight is m[0].weight) == tied
    freed = analyze(m, (x,)).cost_graph
    assert (freed.fixed_bytes, freed.param_bytes) == (real.fixed_bytes, real.param_bytes)
    assert timeline(freed, ()).peak_bytes == timeline(real, ()).peak_bytes


@pytest.mark.slow
def test_an_infeasible_budget_raises_on_every_rank(two_ranks):
    res = two_ranks("infeasible")
    assert [r["raised"] for r in res["ranks"]] == ["InfeasibleBudgetError"] * 2
    # the same error on both ranks; "seconds" is each rank's wall time (0.9 against 1.0 s in a CI run)
    a, b = ({k: v for k, v in r.items() if k != "seconds"} for r in res["ranks"])
    assert a == b and a["unit"] == "MB"


@pytest.mark.slow
def test_mixed_precision_trains_as_fsdp2_does_and_fits(two_ranks):
    """MixedPrecisionPolicy(bf16 parameters, fp32 reduction): the gradients are FSDP2's without
    remat, bit for bit; planned for bf16 gathered parameters and fp32 shards."""
    res = two_ranks("fsdp-bf16")
    for rank in res["ranks"]:
        assert rank["grad_diff_vs_fsdp"] == 0.0 and rank["regions"] > 0
        assert rank["measured"] <= rank["predicted"] <= 1.05 * rank["measured"] and rank["measured"] <= rank["budget"]


@pytest.mark.slow
def test_the_held_out_gpt_keeps_its_per_rank_budget(two_ranks):
    """Issue 23's held-out FSDP2 GPT (vocab 2048: its logits and their cross-entropy hold the
    peak; default resharding), the per-rank budget halfway between the measured peaks of FSDP2
    with and without per-block checkpointing: gradients equal one process on the global batch;
    each rank's measured peak fits, the prediction at or above it, within 5%."""
    res = two_ranks("gpt")
    assert res["diff"]["grad"] <= 1e-6 * max(1.0, res["diff"]["grad_scale"])
    for rank in res["ranks"]:
        base = rank["baselines"]
        assert base["fsdp+per-block"] < rank["budget"] < base["fsdp"] and rank["regions"] > 0
        assert rank["measured"] <= rank["predicted"] <= 1.05 * rank["measured"] and rank["measured"] <= rank["budget"]
    assert res["ranks"][0]["predicted"] == res["ranks"][1]["predicted"]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["llama", "gpt2", "gpt2-ddp"])
def test_hugging_face_causal_lms_train_like_one_process_and_fit(config, two_ranks):
    """A tiny HF Llama (vocab 4096) or GPT-2 under FSDP2 (fully_shard on each decoder layer, then
    the root) or DDP, AdamW: the graph split at the units (NOTE [ the root's graph ]), regions in
    the decoder layers and in the root; the Llama at 60% of its unplanned per-rank peak, or at
    the floor the planner names when that does not fit (its logits' cross-entropy holds it), a
    region over its final norm and head. Gradients and parameters after three steps equal one
    process on the global batch; every step's measured peak on each rank fits the budget and
    the prediction, which is within 5% of the largest."""
    res = two_ranks(config)
    _trains_like_one_process(res["diff"])
    for rank in res["ranks"]:
        assert len(rank["peaks"]) == 3 and rank["regions"] > 0
        assert all(p <= rank["predicted"] <= rank["budget"] for p in rank["peaks"])
        assert rank["predicted"] <= 1.05 * rank["measured"]
        if config != "gpt2-ddp":
            assert 1 <= rank["rewritten_layers"] <= rank["regions"]
        if config == "llama":
            assert rank["floor"] is None or rank["budget"] == rank["floor"]
            assert rank["root_regions"] >= 1
    assert res["ranks"][0]["predicted"] == res["ranks"][1]["predicted"]
