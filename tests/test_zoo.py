"""Real architectures (benchmarks/zoo_models.py): every one plans, trains exactly like the original, and fits.

One test per architecture at 50% of its activation memory (benchmarks/zoo.py prints the same
rows as docs/benchmarks.md's "Real models" table; the plans are conftest's session-cached `zoo_case`, which
test_accuracy.py checks predicted against measured on), then the semantics a wrapped model must
keep: autocast, no_grad and eval, state_dict round trips, tied weights, re-planning for a new shape.
"""
import copy
import importlib.util
import io

import pytest
import torch

from remat.runtime import plan_and_wrap
from remat.runtime.measure import peak_memory, preserved
from benchmarks.zoo_models import ZOO

from helpers import FAST, kept_plans, max_diff, planned_step, step as _step

pytestmark = pytest.mark.slow

HAS_HF = importlib.util.find_spec("transformers") is not None
PATHS = {"transformer": "torch.export", "lstm-lm": "fx with opaque leaves", "unet": "fx",
         "dyn-loop": "fx with opaque leaves", "layerdrop": "fx with opaque leaves", "early-exit": "module tree"}


def _needs(name: str):
    if name.startswith("hf-") and not HAS_HF:
        pytest.skip("transformers is not installed (pip install -e '.[hf]')")


@pytest.mark.parametrize("name", list(ZOO))
def test_architecture_plans_fits_and_trains_identically(zoo_case, name):
    _needs(name)
    c = zoo_case(name)
    ex, budget = c.example, c.activation_budget(0.5)
    wrapped, planned_at = c.fitted(budget)     # where no plan fits 50%, planned at the smallest feasible budget
    assert wrapped.remat.plan.trace_path == PATHS.get(name, "torch.export")
    ref = copy.deepcopy(c.pristine)
    with preserved(wrapped):                   # the cached plan's model stays as it was
        ref_out, ref_rng = _step(ref, ex)
        out, rng = _step(wrapped, ex)
        grads = [(p.grad, q.grad) for p, q in zip(ref.parameters(), wrapped.parameters())
                 if p.grad is not None or q.grad is not None]
        assert all(g is not None and h is not None for g, h in grads), "a parameter has a grad in one model only"
        diff = max(max_diff(ref_out, out), max_diff(*zip(*grads)),
                   max_diff([b.float() for b in ref.buffers()], [b.float() for b in wrapped.buffers()]))
        for p in wrapped.parameters():
            p.grad = None
        measured = peak_memory(lambda: planned_step(wrapped, ex), wrapped, ex.inputs, ex.kwargs or {})
    assert diff == 0.0 and torch.equal(ref_rng, rng)    # outputs, loss, grads, buffers; RNG after
    assert measured <= planned_at, f"{name}: measured {measured} over {planned_at}"
    assert planned_at >= budget
    assert wrapped.remat.plan.regions


def test_untraceable_parts_are_named(zoo_case):
    c = zoo_case("layerdrop")   # `torch.rand(()) < p` blocks: fx would freeze the draw
    wrapped, _ = c.fitted(c.activation_budget(0.5))
    assert {"blocks.0", "blocks.1", "blocks.2", "blocks.3"} <= {m for m, _ in wrapped.remat.plan.opaque}
    wrapped = plan_and_wrap(ZOO["dyn-loop"]().model, 1e6, example_inputs=ZOO["dyn-loop"]().inputs)
    assert [m for m, _ in wrapped.remat.plan.opaque] == ["3"]
    assert "control flow" in wrapped.remat.plan.opaque[0][1]
    assert "GuardOnDataDependentSymNode" in dict(wrapped.remat.plan.meta["trace_attempts"])["torch.export"]


def _pair(name: str, **kw):
    _needs(name)
    ex = ZOO[name](**kw)
    ref = copy.deepcopy(ex.model)
    with kept_plans():      # the subject is the wrapped model's semantics: one plan serves every test
        # 75% of the unplanned peak, resolved by the plan itself (no probe plan: a capture less)
        wrapped = plan_and_wrap(ex.model, "75%", example_inputs=ex.inputs, example_kwargs=ex.kwargs,
                                loss_fn=ex.loss_fn, options=FAST)
    assert wrapped.remat.plan.regions
    return ex, ref, wrapped


def _same_step(ex, ref, wrapped):
    a, ra = _step(ref, ex)
    b, rb = _step(wrapped, ex)
    assert max_diff(a, b) == 0.0 and torch.equal(ra, rb)
    grads = [(p.grad, q.grad) for p, q in zip(ref.parameters(), wrapped.parameters()) if p.grad is not None]
    assert grads and max_diff(*zip(*grads)) == 0.0
    for m in (ref, wrapped):
        m.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["hf-gpt2", "unet"])
def test_autocast_bf16_replans_and_matches(name):
    ex, ref, wrapped = _pair(name)
    at_wrap = len(wrapped.remat.plans)       # 2 where Trainer is loaded and labels given: its call too
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _same_step(ex, ref, wrapped)
    def step():             # its own autocast context, as a training step has: the weights' casts
        with torch.autocast("cpu", dtype=torch.bfloat16):      # are cached per context, so they count
            planned_step(wrapped, ex)
    measured = peak_memory(step, wrapped, ex.inputs, ex.kwargs)
    assert measured <= wrapped.remat.plan.predicted_peak_bytes <= wrapped.remat.plan.budget_bytes
    assert wrapped.remat.plan.predicted_peak_bytes <= 1.05 * measured      # the accuracy contract (test_accuracy.py)
    wrapped.zero_grad(set_to_none=True)
    assert len(wrapped.remat.plans) == at_wrap + 1     # fp32 (planned at wrap) and bf16 activations
    _same_step(ex, ref, wrapped)       # and back to fp32, the first plan again
    assert len(wrapped.remat.plans) == at_wrap + 1


def test_no_grad_and_eval_run_the_original():
    ex, ref, wrapped = _pair("hf-gpt2")
    at_wrap = len(wrapped.remat.plans)     # 2 where Trainer is loaded: its call (num_items_in_batch) too
    with torch.no_grad():
        a, b = ref(**ex.kwargs), wrapped(**ex.kwargs)
    assert type(a) is type(b)
    ref.eval(), wrapped.eval()
    assert not wrapped.training
    a, b = ref(**ex.kwargs), wrapped(**ex.kwargs)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    assert len(wrapped.remat.plans) == at_wrap      # nothing planned in eval mode or without grad


def test_tied_weights_stay_tied():
    ex, ref, wrapped = _pair("hf-gpt2")
    model = wrapped
    assert model.lm_head.weight is model.transformer.wte.weight
    _same_step(ex, ref, wrapped)
    names = [n for n, _ in wrapped.named_parameters()]
    assert "lm_head.weight" not in names and len(names) == len(list(ref.parameters()))


@pytest.mark.parametrize("name", ["hf-llama", "unet"])
def test_state_dict_round_trips(name):
    ex, ref, wrapped = _pair(name)
    assert list(wrapped.state_dict()) == list(ref.state_dict())
    # wrapped -> fresh unwrapped model, through torch.save
    with torch.no_grad():
        for p in wrapped.parameters():
            p.add_(0.01)
    buf = io.BytesIO()
    torch.save(wrapped.state_dict(), buf)
    fresh = ZOO[name](seed=3).model
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), wrapped.state_dict().values()))
    # unwrapped -> wrapped, also with assign=True (new tensors): the regions must use them
    wrapped.load_state_dict(ref.state_dict(), assign=True)
    _same_step(ex, ref, wrapped)


def test_new_shape_replans():
    ex, ref, wrapped = _pair("hf-gpt2")
    short = ZOO["hf-gpt2"](seq_len=32)
    at_wrap = len(wrapped.remat.plans)      # the example call and Trainer's (num_items_in_batch)
    _same_step(short, ref, wrapped)
    assert len(wrapped.remat.plans) == at_wrap + 1
    _same_step(ex, ref, wrapped)
    assert len(wrapped.remat.plans) == at_wrap + 1


def test_hugging_face_cache_output_is_turned_off_as_hf_does():
    _needs("hf-gpt2")
    import transformers
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=256)  # use_cache on
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(256, (2, 32))
    wrapped = plan_and_wrap(model, 1e6, example_kwargs={"input_ids": ids, "labels": ids})
    assert wrapped.remat.plan.trace_path == "torch.export"
    assert "use_cache=False" in dict(wrapped.remat.plan.meta["trace_attempts"])["torch.export as called"]
    torch.manual_seed(1)
    a = ref(input_ids=ids, labels=ids)
    torch.manual_seed(1)
    b = wrapped(input_ids=ids, labels=ids)
    assert torch.equal(a.loss, b.loss) and b.past_key_values is None
