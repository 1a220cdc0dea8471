"""planner/solve/front.py: the exact (K, recompute) front of a segment by DP, judged by brute force over
every plan and by the segment ILP it stands in for (no torch)."""
from __future__ import annotations

import itertools

import pytest

from remat.planner.solve.blocks import segments
from remat.planner.solve.front import cheapest, front
from remat.planner.solve.hierarchy import HierarchicalSolver
from remat.planner.options import SolveOptions
from remat.planner.solve.segment import SegmentILP
from test_hierarchy import block_chain


def _ilp_kept(ilp: SegmentILP, plan) -> float:
    """K as the segment ILP reads it for `plan`: its `kept` expression with the plan's regions fixed
    (the z chains at their least: a cheapest plan's K)."""
    chosen = set(plan)
    ilp.build()
    for c, x in zip(ilp.cands, ilp.x):
        x.lowBound = x.upBound = 1 if c.region in chosen else 0
    try:
        got = ilp._run(ilp.nudge * ilp.kept, 1e18)
    finally:
        for x in ilp.x:
            x.lowBound, x.upBound = 0, 1
    assert got is not None and set(got[0]) == chosen
    return got[1]


def _plans(cands, n: int):
    """Every set of disjoint candidate regions (their plans), by start."""
    by_start = {}
    for c in cands:
        by_start.setdefault(c.region.start, []).append(c)

    def walk(b: int):
        if b >= n:
            yield ()
            return
        yield from walk(b + 1)
        for c in by_start.get(b, ()):
            for rest in walk(c.region.end + 1):
                yield (c,) + rest
    yield from walk(0)


def _families(seed: int, size: int = 4):
    cg = block_chain(seed, n_blocks=3, size=size)
    h = HierarchicalSolver(cg, SolveOptions(improve_evals=0))
    return [(f, f.ilp) for f in h.families if f.ilp.cands]


@pytest.mark.parametrize("seed", range(4))
def test_the_front_is_the_pareto_set_of_every_plan(seed):
    """Every plan of a small segment enumerated, its K read by the ILP's own expression and its cost
    by the simulator: the DP's front is exactly their Pareto set (each point's plan costs and keeps
    what the DP says)."""
    checked = 0
    for fam, ilp in _families(seed, size=7):
        everything = []
        for cs in itertools.islice(_plans(ilp.cands, len(ilp.sub.nodes)), 400):
            plan = tuple(c.region for c in cs)
            everything.append((_ilp_kept(ilp, plan), fam.rep.score(plan).cost_s))
        if len(everything) == 400:           # too many to enumerate: a smaller segment judges it
            continue
        pareto = [p for p in everything
                  if not any(q[0] <= p[0] + 1e-9 and q[1] < p[1] - 1e-12 or q[0] < p[0] - 1e-9 and q[1] <= p[1] + 1e-12
                             for q in everything)]
        got = front(ilp.sub, ilp.cands)
        assert sorted({(round(k, 6), round(c, 12)) for k, c in pareto}) == \
            [(round(p.kept_mb, 6), round(p.cost_s, 12)) for p in got]
        for p in got:
            assert fam.rep.score(p.plan).cost_s == pytest.approx(p.cost_s, rel=1e-12, abs=1e-15)
            assert _ilp_kept(ilp, p.plan) == pytest.approx(p.kept_mb, abs=1e-6)
        checked += len(everything)
    assert checked >= 15                     # plans enumerated: the test judged something


@pytest.mark.parametrize("seed", range(10, 14))
def test_the_front_answers_what_the_segment_ilp_answers(seed):
    """At each front point's K and between two of them, the cheapest plan keeping at most that level
    costs what the segment ILP's optimum (exact on a segment this small) costs."""
    judged = 0
    for fam, ilp in _families(seed, size=6):
        got = front(ilp.sub, ilp.cands)
        ks = [p.kept_mb for p in got]
        levels = ks + [(a + b) / 2 for a, b in zip(ks, ks[1:])]
        for level in levels:
            ours = cheapest(got, level)
            theirs = ilp.cheapest(level)
            assert theirs is not None and ours is not None
            assert fam.rep.score(ours.plan).cost_s == pytest.approx(fam.rep.score(theirs[0]).cost_s, rel=1e-9, abs=1e-12)
            assert ours.kept_mb <= level + 1e-9
            judged += 1
    assert judged >= 3, "the segments gave fewer than 3 levels to judge: the test judged nothing"


def test_segments_of_a_real_shape_have_their_front_in_the_hierarchy():
    """The hierarchical solver takes each family's K-bounded cheapest plans from its front: the
    family's front points are points of the exact front (no CBC run made them)."""
    cg = block_chain(3, n_blocks=4, size=5)
    assert len(segments(cg)) > 2
    h = HierarchicalSolver(cg, SolveOptions(improve_evals=0))
    exact_families = [fam for fam in h.families if fam.exact is not None]
    assert exact_families, "no family has an exact front: the test judged nothing"
    for fam in exact_families:
        exact = {p.plan for p in fam.exact}
        assert len(fam.front) > 2 and all(plan in exact for _, _, plan in fam.front), fam.front


def test_a_segment_past_the_work_limit_is_left_to_the_ilp(monkeypatch):
    """Past its work limit the DP gives up (None), and the family's cheapest plans come from the
    segment ILP again: the plans the hierarchy finds are the same kind, only slower."""
    for fam, ilp in _families(1, size=6):
        assert front(ilp.sub, ilp.cands, work=1) is None
        assert front(ilp.sub, ilp.cands) is not None
    import remat.planner.solve.hierarchy as H
    cg = block_chain(3, n_blocks=4, size=5)
    monkeypatch.setattr(H, "front", lambda sub, cands: front(sub, cands, work=1))
    h = H.HierarchicalSolver(cg, SolveOptions(improve_evals=0))
    assert all(f.exact is None for f in h.families)
    assert any(len(f.front) > 2 for f in h.families)


def test_a_long_front_is_offered_evenly_with_both_ends():
    """Past FRONT_OPTIONS points, the options are spread evenly by rank and keep both ends (the least
    kept and no regions at all); a short front is offered whole."""
    from remat.planner.solve.hierarchy import _spread
    points = list(range(300))
    got = _spread(points, 128)
    assert len(got) == 128 and got[0] == 0 and got[-1] == 299 and got == sorted(set(got))
    assert max(b - a for a, b in zip(got, got[1:])) <= 3
    assert _spread(points[:50], 128) == points[:50]
