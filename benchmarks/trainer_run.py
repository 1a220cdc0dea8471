"""A padded Hugging Face Trainer run with remat, as a user runs it: how many plans, and the seconds
spent planning against the seconds spent training (issue 20's target: 100 steps of random padded
lengths make at most 2 solves and add at most 2x one plan's time).

Tiny GPT-2 from a config (4 layers, d=128, vocab 1024), batch 4, padded lengths 49-63 drawn at
random, default TrainingArguments (CPU). The plan is made at the longest batch (`example_kwargs`);
each step's peak live bytes is metered. Prints a table and writes it to
benchmarks/results/trainer_run.md.

    python benchmarks/trainer_run.py [--steps 100] [--budget 50%]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remat.planner.storage import LiveBytes  # noqa: E402
from remat.runtime import plan_and_wrap  # noqa: E402
from remat.runtime.api import Remat  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--budget", default="50%")
    a = ap.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_integrations import pad    # the padding collator the tests use

    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(4, 1024, (int(torch.randint(49, 64, (), generator=g)),),
                                        generator=g).tolist()} for _ in range(4 * a.steps)]

    def gpt2():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=4, n_embd=128, n_head=4, vocab_size=1024, n_positions=128, use_cache=False))

    planning = [0.0]
    plan_for = Remat.plan_for

    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return plan_for(self, *args, **kwargs)
        finally:
            planning[0] += time.perf_counter() - t
    Remat.plan_for = timed

    def run(model):
        peaks = []

        class Metered(transformers.Trainer):
            def training_step(self, model, inputs, num_items_in_batch=None):
                with LiveBytes(baseline=list(model.parameters()) + list(model.buffers())) as m:
                    loss = super().training_step(model, inputs, num_items_in_batch)
                peaks.append(m.peak_bytes)
                return loss
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(out, max_steps=a.steps, per_device_train_batch_size=4,
                                                  use_cpu=True, report_to="none", save_strategy="no")
            t = time.perf_counter()
            Metered(model=model, args=args, train_dataset=rows, data_collator=pad).train()
            return time.perf_counter() - t, peaks

    plain_s, plain_peaks = run(gpt2())
    model = gpt2()
    t = time.perf_counter()
    plan_and_wrap(model, budget_gb=a.budget, example_kwargs=pad([{"input_ids": [5] * 63}] * 4))
    first_s = time.perf_counter() - t
    planning[0] = 0.0
    train_s, peaks = run(model)
    budget = model.remat.plan.budget_bytes
    lines = [
        f"# Padded Trainer run ({datetime.date.today()}, {platform.machine()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, CPU)", "",
        f"`python benchmarks/trainer_run.py --steps {a.steps} --budget {a.budget}`", "",
        "| what | value |", "|---|---|",
        f"| steps (padded lengths 49-63, batch 4) | {a.steps} |",
        f"| distinct input signatures seen | {len(model.remat.plans)} |",
        f"| solves (plans made) | {model.remat.solves} (1 at plan_and_wrap) |",
        f"| plan_and_wrap (first plan) | {first_s:.1f} s |",
        f"| planning inside the run (covered batches, Trainer's num_items_in_batch) | {planning[0]:.1f} s |",
        f"| training run with remat, planning included | {train_s:.1f} s |",
        f"| training run without remat | {plain_s:.1f} s |",
        f"| budget | {budget} B |",
        f"| largest measured step peak with remat | {max(peaks)} B |",
        f"| largest measured step peak without remat | {max(plain_peaks)} B |",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).resolve().parent / "results" / "trainer_run.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
