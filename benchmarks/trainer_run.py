"""A padded Hugging Face Trainer run with remat, as a user runs it (issue 41's target): after
`plan_and_wrap`, how many captures and solves the run makes, remat's own share of the run's wall
time, and the step time against the same run without remat.

A tiny decoder from a config (random weights; `--model gpt2`: 4 layers, d=128, vocab 1024;
`--model llama`: 2 layers, d=64), batch 4, token rows of random lengths in [--lo, --hi], the
docs' pad-to-longest collator (docs/integrations.md; tests/test_integrations.py `pad`), default
TrainingArguments on CPU. The plan is made at the longest batch the run declares (`example_kwargs`
padded to --hi). Every training step's peak live bytes is metered. Prints a table and writes it
to benchmarks/results/trainer_run.md.

    python benchmarks/trainer_run.py [--model gpt2] [--steps 100] [--budget 50%] [--lo 32] [--hi 512]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from remat.planner.step.storage import LiveBytes
from remat.runtime import plan_and_wrap
from remat.runtime.api import Remat


class Counted:
    """Wraps a function, counting its calls and the wall seconds spent in them (outermost only)."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.fn = owner, name, getattr(owner, name)
        self.calls, self.seconds, self._depth = 0, 0.0, 0
        counted = self

        def wrapper(*args, **kwargs):
            counted.calls += 1
            counted._depth += 1
            t = time.perf_counter()
            try:
                return counted.fn(*args, **kwargs)
            finally:
                counted._depth -= 1
                if counted._depth == 0:
                    counted.seconds += time.perf_counter() - t
        setattr(owner, name, wrapper)

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0


def _model(name: str):
    import transformers
    torch.manual_seed(0)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1024, max_position_embeddings=1024)).train()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=128, n_head=4, vocab_size=1024, n_positions=1024, use_cache=False)).train()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2", choices=("gpt2", "llama"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--lo", type=int, default=32)
    ap.add_argument("--hi", type=int, default=512)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "trainer_run.md"))
    a = ap.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_integrations import pad    # the docs' padding collator, as the tests use it

    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(4, 1024, (int(torch.randint(a.lo, a.hi + 1, (), generator=g)),),
                                        generator=g).tolist()} for _ in range(4 * a.steps)]
    exports, traces = Counted(torch.export, "export"), Counted(torch.fx.Tracer, "trace")
    planning = Counted(Remat, "plan_for")

    def run(model):
        peaks, times = [], []

        class Metered(transformers.Trainer):
            def training_step(self, model, inputs, num_items_in_batch=None):
                t = time.perf_counter()
                with LiveBytes(baseline=list(model.parameters()) + list(model.buffers())) as m:
                    loss = super().training_step(model, inputs, num_items_in_batch)
                times.append(time.perf_counter() - t)
                peaks.append(m.peak_bytes)
                return loss
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(out, max_steps=a.steps, per_device_train_batch_size=4,
                                                  use_cpu=True, report_to="none", save_strategy="no")
            t = time.perf_counter()
            Metered(model=model, args=args, train_dataset=rows, data_collator=pad).train()
            return time.perf_counter() - t, peaks, times

    plain_s, plain_peaks, plain_times = run(_model(a.model))
    model = _model(a.model)
    t = time.perf_counter()
    plan_and_wrap(model, budget_gb=a.budget, example_kwargs=pad([{"input_ids": [5] * a.hi}] * 4))
    first_s = time.perf_counter() - t
    first_solves = model.remat.solves
    for c in (exports, traces, planning):
        c.reset()
    train_s, peaks, times = run(model)
    budget = model.remat.plan.budget_bytes
    ratio = statistics.median(times) / statistics.median(plain_times)
    lines = [
        f"# Padded Trainer run ({datetime.date.today()}, {platform.machine()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, CPU)", "",
        f"`python benchmarks/trainer_run.py --model {a.model} --steps {a.steps} --budget {a.budget} "
        f"--lo {a.lo} --hi {a.hi}`", "",
        "| what | value |", "|---|---|",
        f"| steps (batch 4, pad to longest, lengths random in [{a.lo}, {a.hi}]) | {a.steps} |",
        f"| capture path | {model.remat.plan.trace_path} |",
        f"| plan_and_wrap (plans made up front: {first_solves} solve(s)) | {first_s:.1f} s |",
        f"| captures during the run, after plan_and_wrap (torch.export / fx traces) | {exports.calls} / "
        f"{traces.calls} |",
        f"| solves during the run, after plan_and_wrap | {model.remat.solves - first_solves} |",
        f"| remat's own time in the run (planning calls: captures, checks, solves) | {planning.seconds:.2f} s "
        f"({100 * planning.seconds / train_s:.1f}% of the run) |",
        f"| training run with remat | {train_s:.1f} s |",
        f"| training run without remat | {plain_s:.1f} s |",
        f"| median step with remat / without | {statistics.median(times) * 1e3:.0f} / "
        f"{statistics.median(plain_times) * 1e3:.0f} ms = {ratio:.2f}x |",
        f"| budget | {budget} B |",
        f"| largest measured step peak with remat | {max(peaks)} B |",
        f"| largest measured step peak without remat | {max(plain_peaks)} B |",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
