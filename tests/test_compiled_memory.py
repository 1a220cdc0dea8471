"""Compile mode's prediction (planner/compiled/, runtime/rewrite/compiled.py): the plan reaches
the partitioner as tags, the partition is the compile's, and the replay of its buffers (checked
by Inductor's own wrapper: NOTE [ the compiled check ]) is the allocator's peak of the real
compiled step. The oracle is the compiled step itself, run."""
import contextlib
import copy

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch.utils.checkpoint import CheckpointPolicy

from remat.planner.api import analyze
from remat.planner.compiled.joint import KEY
from remat.planner.compiled.step import compiled_step
from remat.planner.compiled.tags import _forward_nodes, decisions, partition, tag
from remat.planner.result import Region
from remat.planner.solve.baselines import known_plans
from remat.runtime import examples
from remat.runtime.api import plan_and_wrap

from helpers import FAST
from remat.runtime.planning import ExactReplay, compiled_measure
from remat.runtime.rewrite.compiled import CompiledReplay, compiled_module

TOLERANCE = 1.03      # issue 45: predicted within [measured, +3%] at the allocator

pytestmark = [pytest.mark.compile]

MODELS = {"mlp": lambda: examples.mlp(depth=4, width=256, batch=256, in_features=128),
          # one block (a compile's kernels are most of a test's time): its attention's dropout is in a region
          "gpt2": lambda: examples.gpt2(n_layer=1, d_model=64, seq_len=128, batch=4, vocab=256),
          "resnet": lambda: examples.resnet(blocks=(1, 1), width=16, image=16, batch=4)}


def _setup(name):
    ex = MODELS[name]()
    a = analyze(ex.model, example_inputs=ex.inputs, loss_fn=ex.loss_fn)
    return ex, a, compiled_measure(ExactReplay(ex.model, a, ex.loss_fn), {})


@pytest.mark.slow
def test_a_plan_is_tags_and_the_partition_recomputes_its_regions():
    ex, a, measure = _setup("mlp")
    joint, names = measure.compiled.joint, measure.names
    regions = known_plans(a.cost_graph)["every_block"]
    decided = decisions(regions, names)
    gm = copy.deepcopy(joint.gm)
    recomputed = tag(gm, decided)
    by_name = {n: kept for n, _, kept in decided}
    tagged = [n for n in _forward_nodes(gm.graph) if n.meta.get("custom", {}).get(KEY) in by_name]
    assert recomputed > 0 and tagged
    for n in tagged:
        kept = by_name[n.meta["custom"][KEY]]
        assert n.meta["recompute"] == (CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.MUST_RECOMPUTE)
    plain, planned = compiled_step(joint, ()), compiled_step(joint, decided)
    # the regions' ops run again in the backward graph, and the forward keeps less for it
    assert planned.recomputed_ops > plain.recomputed_ops
    assert sum(planned.saved_bytes) < sum(plain.saved_bytes)
    fw, bw = partition(joint, decided)
    assert any(n.name in {m.name for m in fw.graph.nodes} for n in bw.graph.nodes if n.op == "call_function")


@pytest.mark.slow
def test_compile_mode_plans_without_compiling():
    """Planning captures the joint graph on fake tensors and stops: no graph is compiled and no
    step runs until the wrapped model's first call."""
    ex = MODELS["mlp"]()
    counters.clear()
    w = plan_and_wrap(ex.model, "90%", example_inputs=ex.inputs, loss_fn=ex.loss_fn, compile=True)
    p = w.remat.plan
    assert p.regions and p.predicted_peak_bytes <= p.budget_bytes
    assert "own memory plan" in " ".join(p.notes)       # checked (NOTE [ the compiled check ])
    assert not counters["inductor"].get("fxgraph_cache_miss") and not counters["inductor"].get("fxgraph_cache_hit")


@pytest.mark.slow
@pytest.mark.parametrize("name,plan", [("mlp", "every_block"), ("gpt2", "every_block"), ("resnet", "every_block")])
def test_the_prediction_bounds_the_compiled_steps_allocator_peak(name, plan):
    """What compile mode promises: the checked prediction (a plan's `predicted_peak_bytes`) at or
    above the real compiled step's allocator peak and within 3% of it; the modelled one, which the
    fit runs on, within 8% (benchmarks/results/compile.md has both over models, plans, budgets)."""
    ex, a, measure = _setup(name)
    regions = {"none": (), **known_plans(a.cost_graph)}[plan]
    predicted, modelled = measure.compiled.checked(regions), measure(regions)
    measured = CompiledReplay(ex.model, a, ex.loss_fn, {})(regions)
    assert measured <= predicted <= TOLERANCE * measured, (predicted, measured)
    assert abs(modelled / measured - 1) < 0.08, (modelled, measured)


@pytest.mark.slow
@inductor_config.patch(fallback_random=False)
def test_recomputed_dropout_draws_the_forwards_numbers():
    """A compiled GPT whose block is a region recomputes its dropout from the forward's seeds:
    its loss and gradients are the unplanned compiled model's, drawn from the same seed (a fresh mask
    in the recompute would move the gradients by far more than the float32 reordering allowed
    here). The plan is the known one: the planner avoids recomputing this model's attention dropout,
    whose draw the backward keeps as a buffer (NOTE [ the compiled check ])."""
    ex = MODELS["gpt2"]()
    ref, model = copy.deepcopy(ex.model), copy.deepcopy(ex.model)
    a = analyze(model, example_inputs=ex.inputs, loss_fn=ex.loss_fn)
    names = tuple(n.name for n in a.cost_graph.nodes)
    first = next(i for i, n in enumerate(names) if n.startswith("h_0_"))
    regions = (Region(first, names.index("h_0_mlp_dropout")),)     # the block, its three dropouts in it
    planned = compiled_module(model, a, regions, names)
    plain = torch.compile(ref)
    grads = []
    for m, params in ((planned, model.parameters()), (plain, ref.parameters())):
        torch.manual_seed(3)
        out = m(**a.example_inputs) if m is planned else m(*ex.inputs)
        ex.loss_fn(out).backward()
        grads.append([p.grad for p in params])
    for g, r in zip(*grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_larger_budget_never_recomputes_more():
    ex, a, measure = _setup("gpt2")
    from remat.planner.solve.simulate import timeline
    from remat.runtime.steps import Loaded, solve_budget
    loaded = Loaded(ex.model, ex.inputs, {}, ex.loss_fn, "gpt2")
    unplanned = measure(())
    plans = [solve_budget(loaded, a, int(unplanned * f), FAST, measure) for f in (0.85, 0.9, 1.0, 1.1)]
    costs = [timeline(a.cost_graph, p.regions).recompute_s for p in plans]
    assert all(p.predicted_peak_bytes <= p.budget_bytes for p in plans)
    assert costs == sorted(costs, reverse=True), costs
    assert not plans[-1].regions        # the unplanned step fits: nothing recomputed


def test_a_model_on_meta_is_refused_in_compile_mode():
    with torch.device("meta"):
        ex = examples.mlp(depth=2, width=32, batch=8, in_features=16)
    with pytest.raises(ValueError, match="plan a meta model without compile="):
        plan_and_wrap(ex.model, 1.0, example_inputs=ex.inputs, loss_fn=ex.loss_fn, compile=True)


@pytest.mark.slow
def test_an_exported_hugging_face_model_keeps_its_output_and_budget():
    """A model captured by torch.export (its output rebuilt as a ModelOutput): the loss reads
    `.logits` in the prediction's replay as in training, and the compiled step fits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=256,
                                                                 n_positions=128)).train()
    ids = torch.randint(0, 256, (4, 128))       # its modelled peak read 12% under at 85% (NOTE [ the compiled check ])

    def loss_fn(out):
        return out.logits.float().logsumexp(-1).mean()
    wrapped = plan_and_wrap(model, "85%", example_inputs=(ids,), loss_fn=loss_fn, compile=True)
    plan = wrapped.remat.plan
    assert plan.regions and plan.trace_path == "torch.export"
    loss_fn(wrapped(ids)).backward()
    model.zero_grad(set_to_none=True)
    from remat.runtime.measure import peak_memory
    measured = peak_memory(lambda: loss_fn(wrapped(ids)).backward(), model, ids, allocator=True)
    assert measured <= plan.budget_bytes
    assert measured <= plan.predicted_peak_bytes <= TOLERANCE * measured, (plan.predicted_peak_bytes, measured)


@pytest.mark.slow
@pytest.mark.hf
def test_a_labelled_hugging_face_llama_is_checked_exactly_and_in_any_order():
    """An HF Llama whose loss comes from the labels (its logits' zero gradient beside the loss):
    the check frees the tangents as the compiled backward does (NOTE [ boxed gradients ]) and holds
    the CPU flash attention's own buffers (NOTE [ attention's workspace ]): within 3% above its
    allocator peak per block (it read 8% over before, and 0.55% under with the tangents alone
    freed). A plan checked before it is modelled (the fit on checks) gets the same figure (it
    raised on a size still symbolic)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(4, 256, (4, 128))
    a = analyze(model, (), {"input_ids": ids, "labels": ids}, None)
    measure = compiled_measure(ExactReplay(model, a, None), {})
    regions = known_plans(a.cost_graph)["every_block"]
    checked = measure.compiled.checked(regions)           # first: never modelled
    measured = CompiledReplay(model, a, None, {})(regions)
    # the rotary inv_freq buffer (64 B), which Inductor folds in as a constant, is resident too:
    # the stand-in left it out, and the Llama's steps checked 64 B under their allocator peaks
    assert measured <= checked <= TOLERANCE * measured, (checked, measured)
    measure(regions)
    measure.compiled.checks.clear()
    assert measure.compiled.checked(regions) == checked
    # the sqrt plan's backward reuses donated saved tensors (NOTE [ donated buffers ]): checked
    # without them, 1.24% over here (5,032,488 vs 4,970,764 B; the benchmark's Llama 4.7%); with
    # them, at its allocator peak
    regions = known_plans(a.cost_graph)["sqrt"]
    checked, measured = measure.compiled.checked(regions), CompiledReplay(model, a, None, {})(regions)
    assert measured <= checked <= 1.002 * measured, (checked, measured)


@pytest.mark.slow
def test_an_exported_output_of_several_tensors_is_stood_in_leaf_by_leaf():
    """Hugging Face's output with labels is a ModelOutput of the loss and the logits: the compiled
    graph returns both, and the stand-in gives each leaf back (its layout once counted the exported
    structure as one output: the replay raised StopIteration). No compile: capture and stand-in."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                                 n_positions=16)).train()
    ids = torch.randint(0, 64, (2, 16))
    a = analyze(model, (ids,), {"labels": ids}, None)
    measure = compiled_measure(ExactReplay(model, a, None), {})
    assert measure.compiled.joint.layout == (0, 2)          # no mutated input; the loss and the logits
    assert measure(()) > 0 and len(measure.compiled.step(()).outputs) == 2


@pytest.mark.slow
@inductor_config.patch(fallback_random=True)
def test_eager_rng_draws_recomputed_plan_and_train():
    """With Inductor's `fallback_random`, dropout stays an eager-RNG op the partitioner replays from
    saved RNG state (functionalize_rng_ops): the prediction's partition makes that state in the
    captured graph's fake mode (it raised 'fake_mode must not be None' outside the compile)."""
    ex = MODELS["gpt2"]()
    wrapped = plan_and_wrap(ex.model, "90%", example_inputs=ex.inputs, loss_fn=ex.loss_fn, compile=True)
    assert wrapped.remat.plan.regions
    ex.loss_fn(wrapped(*ex.inputs)).backward()
    assert all(p.grad is not None for p in ex.model.parameters())


def test_the_wrapper_replay_frees_a_storage_with_its_last_name():
    """NOTE [ the wrapper's memory plan ], on a wrapper written by hand: a view keeps its base's
    storage, a kernel's several outputs are allocated by its call, a reuse passes the bytes on, and
    a held input is never freed."""
    from remat.planner.compiled.wrapper import Live, replay
    code = """def call(self, args):
        primals_1, = args
        buf0 = empty_strided_cpu((4, ), (1, ), torch.float32)
        buf1 = reinterpret_tensor(buf0, (2, 2), (2, 1), 0)  # alias
        del buf0
        buf2 = torch.ops.aten.foo.default(buf1, primals_1)
        del primals_1
        buf3 = buf2[0]
        buf4 = buf2[1]
        del buf2
        del buf1
        buf5 = reinterpret_tensor(buf3, (8, ), (1, ), 0); del buf3  # reuse
        del buf4
        return (buf5, )
"""
    live = Live(held={"p"})
    live.bind("primals_1", "p", 100)
    replay(code, {"buf0": 16, "buf3": 32, "buf4": 8, "buf5": 32}, live)
    assert (live.peak, live.now) == (156, 132)     # 100 held + 16 + 32 + 8 at the call; 100 + 32 at the end


def test_the_wrapper_replay_keeps_a_fallbacks_only_output_and_a_donated_input_it_reuses():
    """A fallback kernel of one output is called as its own buffer and named again (`buf6 =
    buf5`: the HF Llama's cumsum, 4 kB missed before); a donated saved input taken over by a buffer
    (`buf8 = mm_1; del mm_1  # reuse`, NOTE [ donated buffers ]) moves its bytes, no new ones."""
    from remat.planner.compiled.wrapper import Live, replay
    code = """def call(self, args):
        mm_1, = args
        buf5 = torch.ops.aten.cumsum.default(mm_1, dim=-1)
        buf6 = buf5
        del buf5
        buf8 = mm_1; del mm_1  # reuse
        buf9 = reinterpret_tensor(buf6, (64, ), (1, ), 0); del buf6  # reuse
        return (buf8, buf9)
"""
    live = Live(held=set())
    live.bind("mm_1", "m", 100)
    replay(code, {"buf5": 4096, "buf6": 4096, "buf8": 100}, live)
    assert (live.peak, live.now) == (4196, 4196)


def _memory_lines(code: str) -> list[str]:
    """The lines of a wrapper's `call` that allocate, reuse, alias, call a fallback or free."""
    import re
    body = code[code.index("def call(self, args)"):]
    lines = [line.strip() for line in body[:body.index("\n        return")].splitlines()]
    return [line for line in lines if re.search(r"empty_strided|reinterpret_tensor|\bdel |= buf\d+|torch\.ops|extern_kernels",
                                                line)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "gpt2", "resnet"])
def test_the_kernels_unwritten_leave_the_wrappers_memory_plan_as_it_is(name, monkeypatch):
    """NOTE [ the kernels unwritten ]: each graph's wrapper, read with the C++ kernels' bodies
    unwritten, allocates, reuses and frees as with them written, buffer for buffer, without
    checkpointing and with every block checkpointed; a kernel with a masked load is written (the MLP
    has some), most are not; and where leaving them unwritten fails, the graph is read
    again with them written. Neither the walk for size symbols the check skips (NOTE [ no symbols
    sought ]) nor the values it does not propagate again (NOTE [ the values as traced ]) change it."""
    import remat.planner.compat as compat
    from remat.planner.compiled.step import _read
    from remat.planner.compiled.wrapper import wrapper_memory
    from torch._inductor.scheduler import Scheduler
    _, a, measure = _setup(name)
    written, sought = [], []
    must_write = compat._must_write
    monkeypatch.setattr(compat, "_must_write", lambda p, nodes: written.append(must_write(p, nodes)) or written[-1])
    walk = Scheduler.get_graph_partition_symbol_inputs
    monkeypatch.setattr(Scheduler, "get_graph_partition_symbol_inputs", lambda *a: sought.append(1) or walk(*a))
    for regions in ((), known_plans(a.cost_graph).get("every_block", ())):
        r = _read(measure.compiled.joint, measure.compiled._partition(regions))
        for gm, visible in ((r.fw, r.visible), (r.bw, None)):
            inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]    # as traced, both reads alike
            code, sizes, strides = compat.inductor_wrapper(copy.deepcopy(gm), inputs, visible, sources=True)
            code_u, sizes_u, strides_u = compat.inductor_wrapper(copy.deepcopy(gm), inputs, visible)
            assert _memory_lines(code_u) == _memory_lines(code) and sizes_u == sizes and strides_u == strides
            # NOTE [ no symbols sought ]: the walk for symbols skipped, the same wrapper as after it
            assert not sought
            with monkeypatch.context() as m:
                m.setattr(compat, "no_symbols_sought", contextlib.nullcontext)
                assert compat.inductor_wrapper(copy.deepcopy(gm), inputs, visible) == (code_u, sizes_u, strides_u)
            assert sought
            # NOTE [ the values as traced ]: as Inductor reads it, its values propagated again
            assert compat._as_traced(gm, inputs) is not None or name == "resnet"
            with monkeypatch.context() as m:
                m.setattr(compat, "_as_traced", lambda gm, inputs: None)
                assert compat.inductor_wrapper(copy.deepcopy(gm), inputs, visible) == (code_u, sizes_u, strides_u)
            sought.clear()
    assert not all(written) and (any(written) or name != "mlp")
    r = _read(measure.compiled.joint, measure.compiled._partition(()))
    alone = wrapper_memory(r.bw, r.static, r.counted, None)

    def fails(proxy, nodes):
        raise RuntimeError("an Inductor that moved")
    monkeypatch.setattr(compat, "_register", fails)
    assert wrapper_memory(r.bw, r.static, r.counted, None) == alone
