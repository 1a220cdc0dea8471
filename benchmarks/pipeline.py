"""Pipeline parallelism (issue 44): remat's per-stage plans against uniform per-block checkpointing.

For each schedule (GPipe, 1F1B: a stage a rank; Interleaved1F1B and InterleavedZeroBubble: 2
stages a rank, stages r and r + 2 of 4; ZBVZeroBubble and DualPipeV: stages r and 3 - r) on 2 gloo ranks (a tiny 4-block GPT split by blocks, 4 micro-batches:
benchmarks/pipeline_run.py), the uniform policy every framework applies (every block of every
stage under torch.utils.checkpoint) sets the budget: its largest per-rank peak. remat then plans
each rank for that same per-rank budget (`plan_and_wrap(stage_module, budget, schedule=...)`; an
interleaved rank's stages together, for its one budget): a stage that fits without checkpointing
gets no region. Per rank: the measured peak of the whole `schedule.step` (live storages at the
dispatcher), remat's prediction, the plan's estimated extra compute (recomputed forward time over
the rank's forward, its stages' summed), and seconds per step (median of the steps after the
first). Timings are this machine's (2 shared cores): a ratio in one run.

    python benchmarks/pipeline.py [--steps 6] [--schedules gpipe 1f1b interleaved zero-bubble zbv dualpipev]
        [--out benchmarks/results/pipeline.md]

Regenerate the results file on an idle machine (every schedule, and the 70B job):
`python benchmarks/pipeline.py --steps 6 --job --out benchmarks/results/pipeline.md`.

With `--fsdp`, it runs PP x FSDP2 instead (benchmarks/pipeline_fsdp_run.py: 4 gloo ranks, 2 pipeline
x 2 data-parallel ranks, GPipe, 1F1B and Interleaved1F1B, the same comparison) and writes only its section of the
results file: `python benchmarks/pipeline.py --fsdp --steps 6 --out benchmarks/results/pipeline.md`
(a run without it keeps that section).

With `--job`, it also plans a whole Llama-3-70B job from this process (8 stages, 1F1B, 16
micro-batches of 1 x 8192 tokens, bf16, on meta; `remat report --pipeline`'s library call) at the
uniform policy's largest per-rank peak, and adds its table and planning time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.pipeline_run import (D, MB, MULTI_STAGE, SCHEDULES, SEQ, V_SHAPED, config, held_stages,  # noqa: E402
                                     run_many, stages)
from remat.planner import analyze  # noqa: E402
from remat.planner.solve.simulate import timeline  # noqa: E402
from remat.runtime.distributed.interleaved import uniform_regions  # noqa: E402


# ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV: the tests plan them at 90%, not here
BENCHED = SCHEDULES + ("zero-bubble",) + V_SHAPED


def _median(seconds: list[float]) -> float:
    return statistics.median(seconds[1:] or seconds)


def uniform_extra(schedule: str, rank: int, n_ranks: int = 2) -> float:
    """The per-block policy's estimated extra compute on a rank (% of its stages' forward), by the
    same cost model as remat's plans: every block recomputed once per micro-batch."""
    per = MULTI_STAGE.get(schedule, 1)
    n = n_ranks * per
    every = stages("gpt", n, 2 // per)
    recompute, forward = 0.0, 0.0
    for i in held_stages(schedule, rank, n_ranks):
        x = torch.zeros(MB, SEQ, dtype=torch.long) if i == 0 else torch.zeros(MB, SEQ, D, requires_grad=True)
        cg = analyze(every[i], (x,)).cost_graph
        recompute += timeline(cg, uniform_regions(cg)).recompute_s
        forward += sum(c.cost_s for c in cg.nodes)
    return 100.0 * recompute / forward


def compare(schedule: str, steps: int) -> list[dict]:
    """One row per rank: the per-block policy and remat at the per-block policy's largest peak
    (one spawn of the ranks for the unplanned runs, one for the planned)."""
    uniform, unplanned = run_many([config(schedule, checkpoint_blocks=True, steps=steps), config(schedule, steps=steps)])
    budget = max(max(r["peaks"]) for r in uniform)
    planned = run_many([config(schedule, plan=True, budget=budget, steps=steps, allocator=True)])[0]
    rows = []
    for u, n, p in zip(uniform, unplanned, planned):
        rows.append(dict(schedule=schedule, rank=p["rank"], budget=budget, unplanned=max(n["peaks"]),
                         uniform=max(u["peaks"]), measured=max(p["peaks"]), predicted=p["predicted_peak_bytes"],
                         allocator=p["allocator"],
                         regions=len(p["regions"]), extra=p.get("extra_compute"),
                         uniform_extra=uniform_extra(schedule, p["rank"]),
                         s_unplanned=_median(n["seconds"]), s_uniform=_median(u["seconds"]),
                         s_remat=_median(p["seconds"]), plan_s=p["plan_seconds"]))
    return rows


def table(rows: list[dict]) -> str:
    head = ("| schedule | rank | budget B | unplanned B | per-block B | remat measured B | remat predicted B | "
            "remat allocator B | regions | remat extra compute | per-block extra compute | s/step unplanned | "
            "per-block | remat | plan s |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        extra = "-" if r["extra"] is None else f"{r['extra']:.1f}%"
        out.append(f"| {r['schedule']} | {r['rank']} | {r['budget']} | {r['unplanned']} | {r['uniform']} | "
                   f"{r['measured']} | {r['predicted']} | {r['allocator']} | {r['regions']} | {extra} | "
                   f"{r['uniform_extra']:.1f}% | "
                   f"{r['s_unplanned']:.3f} | "
                   f"{r['s_uniform']:.3f} | {r['s_remat']:.3f} | {r['plan_s']:.1f} |")
    return "\n".join(out)


# ---- PP x FSDP2: 2 pipeline x 2 data-parallel ranks (benchmarks/pipeline_fsdp_run.py) ------------

FSDP_HEADING = "## PP x FSDP2: 2 pipeline x 2 data-parallel ranks"
FSDP_SCHEDULES = ("gpipe", "1f1b", "interleaved")


def compare_fsdp(schedule: str, steps: int) -> list[dict]:
    """One row per rank of the 4 (pipeline rank r // 2, data-parallel rank r % 2): the per-block
    policy and remat at the per-block policy's largest per-rank peak (live storages or the
    allocator's, the larger), each peak the steady steps' (`steady`)."""
    from benchmarks.pipeline_fsdp_run import config as fconfig, run_many as frun, steady
    uniform, unplanned = frun([fconfig(schedule, checkpoint_blocks=True, steps=steps), fconfig(schedule, steps=steps)])
    # its peak as the allocator reads it too: gloo's staging copies, below the dispatcher, count (remat counts them)
    budget = max(max(steady(r["peaks"]), steady(r["allocator"])) for r in uniform)
    planned = frun([fconfig(schedule, plan=True, budget=budget, steps=steps)])[0]
    return [dict(schedule=schedule, rank=p["rank"], pp=p["rank"] // 2, budget=budget, unplanned=steady(n["peaks"]),
                 uniform=steady(u["peaks"]), measured=steady(p["peaks"]), allocator=steady(p["allocator"]),
                 predicted=p["predicted_peak_bytes"], regions=len(p["regions"]), extra=p["extra_compute"],
                 uniform_extra=uniform_extra(schedule, p["rank"] // 2), plan_s=p["plan_seconds"])
            for u, n, p in zip(uniform, unplanned, planned)]


def fsdp_section(rows: list[dict], steps: int, seconds: float) -> str:
    head = ("| schedule | rank | pp rank | budget B | unplanned B | per-block B | remat measured B | remat predicted B | "
            "remat allocator B | regions | remat extra compute | per-block extra compute | plan s |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        out.append(f"| {r['schedule']} | {r['rank']} | {r['pp']} | {r['budget']} | {r['unplanned']} | "
                   f"{r['uniform']} | {r['measured']} | {r['predicted']} | {r['allocator']} | {r['regions']} | "
                   f"{r['extra']:.1f}% | {r['uniform_extra']:.1f}% | {r['plan_s']:.1f} |")
    return (f"\n{FSDP_HEADING}\n\n4 gloo ranks, a 2 x 2 mesh (\"pp\", \"dp\"): the same GPT in 2 stages (interleaved: "
            f"4 of one block, stages r and r + 2 on pipeline rank r), each stage's blocks and module under "
            f"fully_shard over \"dp\", each data-parallel rank its own 4 micro-batches; budget: the per-block policy's "
            f"largest per-rank peak, live storages or the allocator's, the larger. Peaks: the steps after the first, their median ({steps} steps a run), live storages; "
            f"\"allocator\": the CPU allocator's, which also sees gloo's staging copies and the kernels' "
            f"temporaries below the dispatcher. `python benchmarks/pipeline.py --fsdp --steps {steps}` "
            f"({seconds:.0f} s).\n\n" + "\n".join(out) + "\n")


def with_section(path: str, heading: str, section: str) -> str:
    """The text of `path` (a results file) with its section under `heading` (`section_of`)
    replaced by `section`, or `section` added at the end."""
    text = open(path).read() if os.path.exists(path) else ""
    old = section_of(path, heading)
    return text.replace(old, section) if old else text.rstrip("\n") + "\n" + section


LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                  tie_word_embeddings=False)


def job() -> str:
    """The 70B job planned from one process: its table as `remat report --pipeline` prints it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from remat.planner import PlanOptions
    from remat.runtime.distributed.pipeline_job import job_table, plan_job
    cfg = LlamaConfig(**LLAMA3_70B)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).train()
    rows, budget, seconds = plan_job(model, 8, "1f1b", 16, 1, 8192, options=PlanOptions(target_device="cuda"))
    return (f"\n## A Llama-3-70B job planned from one process\n\n8 stages, 1F1B, 16 micro-batches of 1 x 8192 "
            f"tokens, bf16, on meta; budget: the per-block policy's largest per-rank peak (estimated extra "
            f"compute of each stage's forward; the simulator's per-rank predictions). Planned in {seconds:.0f} s "
            f"on 2 shared cores.\n\n```\n{job_table(rows, budget)}\n```\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=(
        "The results file and docs/pipeline.md's table come from an idle machine: python benchmarks/pipeline.py "
        "--steps 6 --job --out benchmarks/results/pipeline.md"))
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the timings: the median after the first)")
    ap.add_argument("--schedules", nargs="+", default=list(BENCHED), choices=BENCHED,
                    help="the schedules compared (default: all; interleaved, zero-bubble, zbv, dualpipev: 2 stages a rank, "
                         "planned together)")
    ap.add_argument("--out", default=None, help="write the results markdown here")
    ap.add_argument("--job", action="store_true", help="also plan the 70B job from this process")
    ap.add_argument("--fsdp", action="store_true", help="only PP x FSDP2 (4 gloo ranks; GPipe, 1F1B, Interleaved1F1B): "
                    "its section of --out is written, the rest of the file kept")
    a = ap.parse_args(argv)
    if a.fsdp:
        return main_fsdp(a)
    t0 = time.perf_counter()
    rows = [r for s in a.schedules for r in compare(s, a.steps)]
    gloo_s = time.perf_counter() - t0
    whole = job() if a.job else ""
    text = (f"# Pipeline parallelism: remat per stage against per-block checkpointing\n\n"
            f"torch {torch.__version__}, 2 gloo ranks on 2 shared CPU cores, a 4-block GPT (d=64, 2 blocks a "
            f"rank: one stage, or under interleaved 1F1B and zero bubble two of one block), 4 micro-batches of "
            f"2x32 tokens; budget: "
            f"the per-block policy's largest per-rank peak; extra compute: of the rank's forward; measured: live "
            f"storages, the largest of the steps; allocator: one more step of the planned run, the CPU allocator's "
            f"peak. "
            f"`python benchmarks/pipeline.py --steps {a.steps} --schedules {' '.join(a.schedules)}"
            f"{' --job' if a.job else ''}` (the gloo runs "
            f"{gloo_s:.0f} s, {time.perf_counter() - t0:.0f} s in all).\n\n" + table(rows) + "\n" + whole)
    print(text)
    if a.out:               # the PP x FSDP2 section (--fsdp) kept
        kept = section_of(a.out, FSDP_HEADING)
        with open(a.out, "w") as f:
            f.write(text.rstrip("\n") + "\n" + kept if kept else text)
    return 0


def section_of(path: str, heading: str) -> str:
    """The section under `heading` of `path` (to the next "## " or the end), else ""."""
    text = open(path).read() if os.path.exists(path) else ""
    at = text.find("\n" + heading + "\n")
    if at < 0:
        return ""
    end = text.find("\n## ", at + 1)
    return text[at:end if end >= 0 else len(text)]


def main_fsdp(a) -> int:
    t0 = time.perf_counter()
    rows = [r for s in FSDP_SCHEDULES for r in compare_fsdp(s, a.steps)]
    section = fsdp_section(rows, a.steps, time.perf_counter() - t0)
    print(section)
    if a.out:
        text = with_section(a.out, FSDP_HEADING, section)
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
