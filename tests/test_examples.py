"""Tests for the built-in example models in runtime.examples."""
import pytest
import torch
import torch.fx

from remat.runtime.examples import EXAMPLES, Example, gpt2, resnet, unet

NAMES = sorted(EXAMPLES)


@pytest.fixture(scope="module", params=NAMES)
def example(request) -> Example:
    return EXAMPLES[request.param]()


def _run(module, inputs, seed=123):
    torch.manual_seed(seed)
    return module(*inputs)


def test_every_built_in_is_a_cli_model(capsys):
    """The names the CLI takes are the registry's: each one loads, and an unknown name lists them all."""
    from remat.runtime.cli.session import UsageError, load_model
    for name in EXAMPLES:
        assert load_model(name).label == f"built-in {name}"
    with pytest.raises(UsageError) as e:
        load_model("no-such-model")
    assert all(name in str(e.value) for name in EXAMPLES)


def test_trace_matches_eager(example):
    model, inputs, loss_fn, _ = example
    assert model.training
    traced = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        expected = _run(model, inputs)
        got = _run(traced, inputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_loss_and_backward(example):
    model, inputs, loss_fn, _ = example
    model.zero_grad(set_to_none=True)
    loss = loss_fn(_run(model, inputs))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


@pytest.mark.parametrize("name", NAMES)
def test_deterministic(name):
    a, b = EXAMPLES[name](), EXAMPLES[name]()
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    for x, y in zip(a.inputs, b.inputs, strict=True):
        assert torch.equal(x, y)
    out = _run(a.model, a.inputs)
    assert torch.equal(a.loss_fn(out), b.loss_fn(out))  # same targets
    c = EXAMPLES[name](seed=1)
    assert not torch.equal(a.inputs[0], c.inputs[0])


def test_factories_leave_global_rng_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    EXAMPLES["mlp"](depth=1, width=8, batch=2, in_features=4)
    assert torch.equal(torch.rand(3), expected)


def test_gpt2_shapes_and_tied_head():
    model, (idx,), _, _ = gpt2()
    assert model.lm_head.weight is model.wte.weight
    assert idx.dtype == torch.long and idx.shape == (4, 128)
    with torch.no_grad():
        assert model(idx).shape == (4, 128, 1024)


@pytest.mark.parametrize("factory", [resnet, unet])
def test_batchnorm_running_stats_update(factory):
    model, inputs, _, _ = factory()
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns
    before = [bn.running_mean.clone() for bn in bns]
    with torch.no_grad():
        model(*inputs)
    assert all(not torch.equal(b, bn.running_mean) for b, bn in zip(before, bns))


def test_unet_output_shape():
    model, (x,), _, _ = unet()
    with torch.no_grad():
        assert model(x).shape == (x.size(0), 1, x.size(2), x.size(3))


@pytest.mark.slow
def test_gpt2_small_parameter_count():
    model = gpt2(n_layer=12, d_model=768, n_head=12, seq_len=1024, batch=8, vocab=50257).model
    n_params = sum(p.numel() for p in model.parameters())
    assert 120e6 < n_params < 130e6
    assert model.lm_head.weight is model.wte.weight
