"""The report of one plan: its checkpoint regions as Segments (what each keeps, drops and
costs, and whether the plan needs it) and the text `remat report` prints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from remat.planner import CostGraph, PlanOptions
from remat.planner.result import Plan, Region
from remat.planner.solve.simulate import keep_release, region_index, region_recompute, timeline

from remat.planner.budget import size_text


@dataclass(frozen=True)
class Segment:
    """One checkpoint region of a plan, in numbers a person can judge."""
    index: int
    start: int
    end: int
    first_node: str
    last_node: str
    modules: str              # the modules it spans
    saved_nodes: int          # nodes whose outputs SAC keeps (0: everything is recomputed)
    kept_bytes: int           # activations made in the region still kept for backward
    recomputed_bytes: int     # activations the unplanned step keeps and this region drops
    recompute_flops: int
    recompute_s: float        # estimated time of its recompute and its fixed cost (Plan.cost_model says how)
    peak_without_bytes: int   # predicted peak of the plan without this region (safety margin included)
    needed: bool              # without it the plan is over budget


# ----------------------------------------------------------------------------- segments
def _common_module(modules: list[str]) -> str:
    parts = [m.split(".") for m in modules]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def _modules_label(cg: CostGraph, r: Region) -> str:
    """The modules a region spans: 'h.0 .. h.1', 'h.1.ln_1 .. h.1.attn', 'drop .. h.0.attn.c_proj'."""
    nodes = cg.nodes[r.start:r.end + 1]
    common = _common_module([c.module for c in nodes]) if all(c.module for c in nodes) else ""
    depth = len(common.split(".")) + 1 if common else None
    first, last = (".".join(c.module.split(".")[:depth]) or c.name for c in (nodes[0], nodes[-1]))
    return first if first == last else f"{first} .. {last}"


def segments(cg: CostGraph, plan: Plan, options: PlanOptions) -> list[Segment]:
    """Per region: what it keeps and drops, what its recompute costs, and whether the plan needs it."""
    n = len(cg.nodes)
    recomputes = [region_recompute(cg, r) for r in plan.regions]
    kept = keep_release(cg, plan.regions, region_index(n, plan.regions), [rc[1] for rc in recomputes])
    kept_unplanned = keep_release(cg, (), [-1] * n, [])
    margin = 1.0 + options.safety_margin
    out = []
    for k, (r, (_, _, _, flops, secs)) in enumerate(zip(plan.regions, recomputes)):
        made = [i for i, s in enumerate(cg.storages) if s.producer in r]
        others = plan.regions[:k] + plan.regions[k + 1:]
        without = math.ceil(timeline(cg, others).peak_bytes * margin)
        out.append(Segment(
            index=k, start=r.start, end=r.end, first_node=cg.nodes[r.start].name, last_node=cg.nodes[r.end].name,
            modules=_modules_label(cg, r), saved_nodes=len(r.saved),
            kept_bytes=sum(cg.storages[i].bytes for i in made if kept[i] is not None),
            recomputed_bytes=sum(cg.storages[i].bytes for i in made
                                 if kept[i] is None and kept_unplanned[i] is not None),
            recompute_flops=flops, recompute_s=secs, peak_without_bytes=without,
            needed=without > plan.budget_bytes))
    return out


def _why(s: Segment, plan: Plan) -> str:
    if s.needed:
        over = 100.0 * (s.peak_without_bytes - plan.budget_bytes) / plan.budget_bytes
        return f"without it peak {size_text(s.peak_without_bytes)}, {over:.0f}% over budget"
    return f"without it peak {size_text(s.peak_without_bytes)} fits; kept by the {plan.solver} solver"


# ----------------------------------------------------------------------------- text output
def table(headers: list[str], rows: list[list[str]], align: str) -> str:
    """Columns padded to their widest cell; align has one 'l' or 'r' per column."""
    widths = [max(len(x) for x in col) for col in zip(headers, *rows)]

    def line(cells):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _mode(s: Segment) -> str:
    return f"SAC keeps {s.saved_nodes}" if s.saved_nodes else "full"


def report_text(plan: Plan, segs: list[Segment], label: str, budget_text: str) -> str:
    pct = 100.0 * (plan.unplanned_peak_bytes - plan.predicted_peak_bytes) / plan.unplanned_peak_bytes
    smallest = f", smallest feasible {size_text(plan.min_feasible_bytes)}" if plan.min_feasible_bytes else ""
    lines = [
        f"model          {label}: {len(plan.node_names)} nodes",
        f"graph          {plan.trace_path}" + "".join(f"\n               {path} not taken: {why}"
                                                     for path, why in plan.meta.get("trace_attempts", ())),
        f"budget         {size_text(plan.budget_bytes)}" + (f" ({budget_text})" if budget_text else ""),
        f"peak           {size_text(plan.unplanned_peak_bytes)} without a plan -> "
        f"{size_text(plan.predicted_peak_bytes)} with it (-{pct:.1f}%){smallest}"
        + (f"; held by the {plan.peak_phase}" if plan.peak_phase else ""),
        f"extra compute  {plan.extra_compute_pct:.1f}% of the forward: recompute "
        f"{plan.recompute_flops / 1e9:.3g} of {plan.total_flops / 1e9:.3g} GFLOP, "
        f"est. {plan.recompute_s * 1e3:.1f} ms ({plan.cost_model} costs)",
        f"solver         {plan.solver}: {plan.status}, {plan.gap_text}, {plan.solve_s:.2f} s",
    ]
    if "timing" in plan.meta:               # --time: runtime.measure.timing
        lines.append(f"time           {plan.meta['timing']['text']}")
    lines.append("")
    if segs:
        measured = list(plan.meta.get("timing", {}).get("region_recompute_s", ()))
        rows = [[str(s.index), f"{s.start}..{s.end}", s.modules, _mode(s), size_text(s.kept_bytes),
                 size_text(s.recomputed_bytes), f"{s.recompute_flops / 1e9:.3f}", f"{s.recompute_s * 1e3:.2f}"]
                + ([_ms(measured[s.index])] if measured else []) + [_why(s, plan)] for s in segs]
        lines.append(table(["#", "nodes", "modules", "mode", "kept", "recomputed", "GFLOP", "est ms"]
                           + (["meas ms"] if measured else []) + ["why chosen"], rows,
                           "rrllrrrr" + ("r" if measured else "") + "l"))
        if measured:
            lines.append("est ms: a region's recompute and its fixed cost, estimated; meas ms: its recompute in "
                         "backward, the fastest of the timed steps (-: it recomputed nothing)")
    else:
        lines.append("no checkpoint regions: the step fits the budget as it is")
    lines.append("opaque modules:" + ("" if plan.opaque else " none"))
    lines.extend(f"  {mod}: {why}" for mod, why in plan.opaque)
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)
