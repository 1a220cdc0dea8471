"""planner/solve/lower.py: the cheapest plan of a segment under a level of K and a cap on its peak, by DP,
judged by brute force over every plan (the simulator's peak, the segment ILP's K) and by the
segment ILP it stands in for (no torch)."""
from __future__ import annotations

import itertools

import pytest

from remat.planner.solve import ilp as _ilp
from remat.planner.solve.front import cheapest, front
from remat.planner.solve.lower import TooMuchWork, cheapest_under, least_peak_under
from remat.planner.options import SolveOptions
from remat.planner.solve.simulate import timeline
from test_front import _families, _ilp_kept, _plans
from test_hierarchy import block_chain


def _every_plan(fam, ilp, most: int = 300):
    """(plan, K, peak, recompute) of every plan of the family's segment; None when more than `most`."""
    out = []
    for cs in itertools.islice(_plans(ilp.cands, len(ilp.sub.nodes)), most):
        plan = tuple(c.region for c in cs)
        out.append((plan, _ilp_kept(ilp, plan), timeline(ilp.sub, plan).peak_bytes, fam.rep.score(plan).cost_s))
    return None if len(out) == most else out


@pytest.mark.parametrize("seed", [0, 1] + [pytest.param(s, marks=pytest.mark.slow) for s in (2, 5, 8)])
def test_the_lower_dp_is_the_cheapest_plan_within_both_bounds(seed):
    """At levels of K and caps on the peak taken from the plans themselves, the DP's plan costs the
    least of every plan within both (None exactly when no plan is), and its simulated peak and K are
    within them; with no cap it answers what the front answers."""
    checked = 0
    for size in (5, 7):
        for fam, ilp in _families(seed, size=size):
            plans = _every_plan(fam, ilp)
            if plans is None:                    # too many to enumerate: a smaller segment judges it
                continue
            points = front(ilp.sub, ilp.cands)
            levels = sorted({k for _, k, _, _ in plans})
            peaks = sorted({p for _, _, p, _ in plans})
            for level in levels[::max(1, len(levels) // 5)] + [levels[-1]]:
                free = cheapest_under(ilp.sub, ilp.cands, level, 10**18)
                assert free.cost_s == pytest.approx(cheapest(points, level).cost_s, rel=1e-12, abs=1e-15)
                for cap in peaks[::max(1, len(peaks) // 6)] + [peaks[0] - 1]:
                    want = min((c for _, k, p, c in plans if k <= level + 1e-9 and p <= cap), default=None)
                    got = cheapest_under(ilp.sub, ilp.cands, level, cap)
                    assert (got is None) == (want is None), (level, cap, got, want)
                    if got is not None:
                        assert got.cost_s == pytest.approx(want, rel=1e-12, abs=1e-15)
                        assert fam.rep.score(got.plan).cost_s == pytest.approx(got.cost_s, rel=1e-12, abs=1e-15)
                        assert timeline(ilp.sub, got.plan).peak_bytes <= cap
                        assert _ilp_kept(ilp, got.plan) <= level + 1e-6
                    checked += 1
    assert checked >= 40                     # bounds judged: the test judged something


@pytest.mark.parametrize("seed", [3, 4] + [pytest.param(s, marks=pytest.mark.slow) for s in (6, 9)])
def test_the_least_peak_dp_is_the_cheapest_plan_of_least_peak(seed):
    """At levels of K taken from the plans, the least-peak DP's plan has the least simulated peak of
    every plan keeping at most the level, and the least recompute of those."""
    checked = 0
    for size in (5, 7):
        for fam, ilp in _families(seed, size=size):
            plans = _every_plan(fam, ilp)
            if plans is None:
                continue
            levels = sorted({k for _, k, _, _ in plans})
            for level in levels[::max(1, len(levels) // 6)] + [levels[-1], levels[0] - 1]:
                within = [(p, c) for _, k, p, c in plans if k <= level + 1e-9]
                got = least_peak_under(ilp.sub, ilp.cands, level)
                assert (got is None) == (not within)
                if got is not None:
                    least = min(p for p, _ in within)
                    assert timeline(ilp.sub, got.plan).peak_bytes == least
                    assert got.cost_s == pytest.approx(min(c for p, c in within if p == least), rel=1e-12, abs=1e-15)
                    assert _ilp_kept(ilp, got.plan) <= level + 1e-6
                checked += 1
    assert checked >= 10


@pytest.mark.parametrize("seed", [20, 22, 26])
def test_the_lower_dp_answers_what_the_segment_ilp_answers(seed):
    """For each front point's plan, the cheapest plan keeping no more at a lower peak (the hierarchy's
    lower-peak search) costs what the segment ILP with its bound on the peak finds (exact here)."""
    asked = found = 0
    for fam, ilp in _families(seed, size=6):
        for p in front(ilp.sub, ilp.cands):
            k = fam.rep.score(p.plan).kept * _ilp.MB + ilp.tol
            peak = timeline(ilp.sub, p.plan).peak_bytes
            ours = cheapest_under(ilp.sub, ilp.cands, k, peak - 2 * round(ilp.tol / _ilp.MB))
            theirs = ilp.cheapest(k, peak * _ilp.MB - 2 * ilp.tol)
            assert (ours is None) == (theirs is None)
            if ours is not None:
                assert ours.cost_s == pytest.approx(fam.rep.score(theirs[0]).cost_s, rel=1e-9, abs=1e-12)
                found += 1
            asked += 1
    assert asked >= 6 and found >= 3


def test_the_hierarchy_lowers_peaks_by_the_dp_and_falls_back_to_the_ilp(monkeypatch):
    """Where a family's exact front was made, its lower-peak and least-peak searches run no CBC;
    past the DP's work limit they are the segment ILP's again, and the plan for the budget fits
    either way."""
    import remat.planner.solve.hierarchy as H
    import remat.planner.solve.lower as L
    from remat.planner.solve.segment import SegmentILP
    cg = block_chain(3, n_blocks=6, size=6)
    budget = (timeline(cg, ()).peak_bytes + cg.fixed_bytes) // 2
    asked = []
    real = SegmentILP.cheapest
    monkeypatch.setattr(SegmentILP, "cheapest",
                        lambda self, below, peak_below=None, start=None:
                        asked.append(peak_below if self.cands else None) or real(self, below, peak_below, start))
    least = []
    real_least = SegmentILP.least_peak
    monkeypatch.setattr(SegmentILP, "least_peak",
                        lambda self, below: least.append(bool(self.cands)) or real_least(self, below))
    h = H.HierarchicalSolver(cg, SolveOptions(improve_evals=0))
    assert all(f.exact is not None for f in h.families if f.ilp.cands)
    by_dp = h.solve(cg, budget)
    assert by_dp is not None and timeline(cg, by_dp.regions).peak_bytes <= budget
    assert any(f.lowered for f in h.families) and not [p for p in asked if p is not None]
    floor = h.min_peak()
    assert h.low_done and not any(least)
    assert timeline(cg, floor.regions).peak_bytes <= timeline(cg, by_dp.regions).peak_bytes

    def limited(*args, **kwargs):
        raise TooMuchWork("limit")
    monkeypatch.setattr(H, "cheapest_under", limited)
    monkeypatch.setattr(H, "least_peak_under", limited)
    h = H.HierarchicalSolver(cg, SolveOptions(improve_evals=0))
    by_ilp = h.solve(cg, budget)
    assert by_ilp is not None and timeline(cg, by_ilp.regions).peak_bytes <= budget
    assert [p for p in asked if p is not None]
    h.min_peak()
    assert any(least)
    assert L.cheapest_under is not limited


def test_past_its_work_limit_the_dp_gives_up():
    for fam, ilp in _families(1, size=6):
        with pytest.raises(TooMuchWork):
            cheapest_under(ilp.sub, ilp.cands, 1e9, 10**18, work=1)
