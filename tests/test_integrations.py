"""remat as a drop-in, run the way users run it: a real Hugging Face Trainer (default arguments,
a padding collator, periodic checkpoints, evaluation, reload), a real accelerate Accelerator
(bf16 autocast, unwrap_model, save_pretrained) and a real Lightning Trainer (fit, checkpoint,
load). The oracle is the same run without remat: losses bitwise equal; the measured peak of
every training step within the budget."""
from __future__ import annotations

import copy
import inspect
import re
from pathlib import Path

import pytest
import torch

from remat.planner.step.storage import LiveBytes
from remat.runtime import plan_and_wrap

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")


def _gpt2(seed: int = 0):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg).train()


def _rows(n: int, lo: int = 24, hi: int = 40, seed: int = 1) -> list[dict]:
    """Token rows of random lengths in [lo, hi), as a tokenized dataset holds them."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(4, 512, (int(torch.randint(lo, hi, (), generator=g)),), generator=g).tolist()}
            for _ in range(n)]


def pad(rows: list[dict]) -> dict:
    """A padding collator: each batch to its longest row; labels -100 on the pads."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _longest(batch: int, hi: int = 40) -> dict:
    return pad([{"input_ids": [5] * (hi - 1)}] * batch)


class _Metered:
    """Mixed into a Trainer: each training step's peak live bytes (parameters, buffers, inputs,
    activations, gradients: what the budget covers without an optimizer)."""
    peaks: list[int]

    def training_step(self, model, inputs, num_items_in_batch=None):
        with LiveBytes(baseline=list(model.parameters()) + list(model.buffers())) as meter:
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.peaks.append(meter.peak_bytes)
        return loss


def _trainer(model, out, train, evaluate, **kw):
    class Trainer(_Metered, transformers.Trainer):
        pass
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=12, save_steps=6, eval_strategy="steps",
                                          eval_steps=6, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                                          use_cpu=True, report_to="none", **kw)
    t = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluate, data_collator=pad)
    t.peaks = []
    return t


def test_trainer_with_default_arguments_trains_evaluates_saves_and_reloads(tmp_path):
    rows = _rows(64)
    ref_model, model = _gpt2(), _gpt2()
    plain = _trainer(ref_model, tmp_path / "plain", rows[:48], rows[48:])
    plain.train()
    unplanned = max(plain.peaks)

    budget = int(0.8 * unplanned)
    assert plan_and_wrap(model, budget_gb=budget / 1e9, example_kwargs=_longest(4)) is model
    assert type(model) is transformers.GPT2LMHeadModel and model.lm_head.weight is model.transformer.wte.weight
    trainer = _trainer(model, tmp_path / "remat", rows[:48], rows[48:])
    trainer.train()

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses == [h["loss"] for h in plain.state.log_history if "loss" in h]
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    assert max(trainer.peaks) <= budget < unplanned, (trainer.peaks, budget)
    # one plan for the run: the example's, and one for Trainer's num_items_in_batch (another graph)
    assert model.remat.solves <= 2 and len(model.remat.plans) >= 3

    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == plain.evaluate()["eval_loss"]
    for step in (6, 12):                               # periodic checkpoints load as the model
        loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "remat" / f"checkpoint-{step}")
        assert loaded.config.n_layer == 2
    trainer.save_model(tmp_path / "final")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "final")
    for (k, p), q in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), k
    with torch.no_grad():                              # generate runs the model's own forward
        out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
        assert torch.equal(out, loaded.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False))


def test_trainer_gradient_checkpointing_is_taken_over_once(tmp_path):
    rows = _rows(24)
    model = _gpt2()
    plan_and_wrap(model, "70%", example_kwargs=_longest(4))
    trainer = _trainer(model, tmp_path, rows[:16], rows[16:], gradient_checkpointing=True)
    with pytest.warns(UserWarning, match="Hugging Face gradient checkpointing was enabled; remat turned it off"):
        trainer.train()
    assert not getattr(model, "is_activation_checkpointing", model.is_gradient_checkpointing)
    assert max(trainer.peaks) <= model.remat.plan.budget_bytes


def test_accelerate_bf16_prepare_unwrap_and_save(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    batches = [pad(_rows(4, seed=s)) for s in range(3)]

    def run(model):
        accelerate.state.AcceleratorState._reset_state(True)      # another test's Trainer made one
        acc = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        prepared, opt = acc.prepare(model, opt)
        losses, peaks = [], []
        for b in batches:
            with LiveBytes(baseline=list(model.parameters()) + list(model.buffers())) as meter:
                loss = prepared(**b).loss
                acc.backward(loss)
            peaks.append(meter.peak_bytes)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return acc, prepared, losses, peaks

    ref = _gpt2()
    _, _, ref_losses, ref_peaks = run(ref)
    model = _gpt2()
    budget = int(0.85 * max(ref_peaks))
    plan_and_wrap(model, budget / 1e9, example_kwargs=_longest(4))
    acc, prepared, losses, peaks = run(model)
    assert [x.item() for x in losses] == [x.item() for x in ref_losses]
    assert max(peaks) <= budget, (peaks, budget)
    unwrapped = acc.unwrap_model(prepared)
    assert unwrapped is model
    unwrapped.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    for p, q in zip(model.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(p, q)


def test_lightning_fits_checkpoints_and_loads(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    rows = _rows(32)

    class LM(L.LightningModule):
        def __init__(self, budget: float | None = None):
            super().__init__()
            self.net = _gpt2()
            if budget is not None:
                plan_and_wrap(self.net, budget_gb=budget)
            self.losses = []

        def training_step(self, batch, _):
            loss = self.net(**batch).loss
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(module, root):
        loader = torch.utils.data.DataLoader(rows, batch_size=4, collate_fn=pad)
        trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=str(root))
        trainer.fit(module, loader)
        return trainer

    torch.manual_seed(0)
    ref = LM()
    fit(ref, tmp_path / "plain")
    torch.manual_seed(0)
    module = LM(budget=1.0)
    trainer = fit(module, tmp_path / "remat")
    assert [x.item() for x in module.losses] == [x.item() for x in ref.losses]
    assert module.net.remat.plans                      # trained with a plan
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    loaded = LM.load_from_checkpoint(tmp_path / "last.ckpt", budget=1.0)
    for p, q in zip(module.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(p, q)


def test_the_wrapped_model_keeps_its_signature_and_copies():
    model = _gpt2()
    sig = inspect.signature(model.forward)
    plan_and_wrap(model, budget_gb="90%")
    assert inspect.signature(model.forward) == sig
    twin = copy.deepcopy(model)
    assert twin.remat.model is twin and twin.forward.__self__ is twin


_DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"
SNIPPETS = re.findall(r"^## (.+?)\n```python\n(.*?)^```", _DOC.read_text(), re.S | re.M)


@pytest.mark.parametrize("title,code", SNIPPETS, ids=[t for t, _ in SNIPPETS])
def test_the_integrations_guide_runs(title, code, tmp_path, monkeypatch):
    """Each example of docs/integrations.md runs as written, in a fresh folder."""
    pytest.importorskip("accelerate")
    pytest.importorskip("lightning")
    import accelerate
    accelerate.state.AcceleratorState._reset_state(True)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, f"{_DOC.name}: {title}", "exec"), namespace)
    model = namespace.get("model")
    net = namespace["trainer"].lightning_module.net if "LM" in namespace else model
    net = getattr(net, "module", net)
    assert net.remat.plans, f"{title}: trained without a plan"
