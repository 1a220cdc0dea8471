"""The environment a test session runs in (one torch thread per xdist worker; plan caches in
temporary directories), the fixtures that hand out shared models (`case`, `zoo_case`, `builtin`)
and the collection hooks (the hf lane, xdist groups). What tests import is in helpers.py."""
import os
import tempfile

import pytest
import torch

# One torch thread per xdist worker: two workers on two cores, not four threads fighting over them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Tests plan anew unless they test the plan cache (tests/test_plan_cache.py turns it on); nothing
# is written to the user's cache directory.
os.environ["REMAT_CACHE"] = "0"
os.environ["REMAT_CACHE_DIR"] = tempfile.mkdtemp(prefix="remat-test-cache-")
# kept_plans()' directory: one for the session, shared by the xdist workers (they inherit the
# controller's environment, set when it loads this file)
os.environ.setdefault("REMAT_TEST_KEPT_PLANS", tempfile.mkdtemp(prefix="remat-test-kept-plans-"))
# Solved ILPs are kept on disk for the session's workers and the CLI's subprocesses (planner/solve/cbc.py,
# NOTE [ solved once ]): an ILP one test solved is not solved again by another, and the plan is the
# same (node-limited solves are a function of their input; results cut off by time are not kept).
os.environ["REMAT_SOLVE_CACHE"] = "1"
os.environ.setdefault("REMAT_SOLVE_CACHE_DIR", tempfile.mkdtemp(prefix="remat-test-solves-"))


from helpers import Case, Planned  # noqa: E402  (after the environment above is set)

_CASES: dict[tuple, Case] = {}


@pytest.fixture(scope="session")
def case():
    """name (and the factory's keyword arguments, for a variant) -> its Case, made once a session."""
    def get(name: str, **kwargs) -> Case:
        key = (name, tuple(sorted(kwargs.items())))
        if key not in _CASES:
            _CASES[key] = Case(name, **kwargs)
        return _CASES[key]
    return get


_ZOO: dict[str, Planned] = {}


@pytest.fixture(scope="session")
def zoo_case():
    """benchmarks/zoo_models.py models, each planned once per budget for the whole session (test_zoo, test_accuracy)."""
    from benchmarks.zoo_models import ZOO

    def get(name: str) -> Planned:
        if name not in _ZOO:
            _ZOO[name] = Planned(name, ZOO[name]())
        return _ZOO[name]
    return get


_BUILTIN: dict[str, Planned] = {}


@pytest.fixture(scope="session")
def builtin(case):
    """runtime.examples models (the `case` fixture's, the default sizes), each planned once per budget
    for the whole session (test_wrap, test_accuracy)."""
    def get(name: str) -> Planned:
        if name not in _BUILTIN:
            _BUILTIN[name] = Planned(name, case(name).example)
        return _BUILTIN[name]
    return get


# Module-scoped fixtures that run many subprocesses or a whole job for their module's tests: each
# xdist worker that runs one of those tests runs the fixture again, so their tests go to one worker
# (with --dist loadgroup). In CI at 5101df5 both workers ran each of them: 30-110 s each time.
ONE_WORKER = frozenset({"bad_runs", "slow_runs", "quick_runs", "two_ranks", "dist", "runs"})


@pytest.hookimpl(wrapper=True)     # around xdist's worker, which appends each group to its node id
def pytest_collection_modifyitems(config, items):
    _mark(items)
    yield
    _check_groups(config, items)


def _mark(items):
    """The Hugging Face lane: every test on an hf-* zoo model is marked `hf` (pytest -m "not hf").
    Tests that take a session-planned model (`zoo_case`, `builtin`) by its name are grouped by it:
    with `-n 2 --dist loadgroup` one worker plans each such model once for all of them (test_zoo,
    test_accuracy and test_wrap share its plans at 50% and at the floor), where two would each plan it."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(v, str) and v.startswith("hf-") for v in params.values()):
            item.add_marker(pytest.mark.hf)
        fixtures = getattr(item, "fixturenames", ())
        if isinstance(params.get("name"), str) and ("zoo_case" in fixtures or "builtin" in fixtures):
            item.add_marker(pytest.mark.xdist_group(("zoo-" if "zoo_case" in fixtures else "builtin-") + params["name"]))
        elif shared := [f for f in fixtures if f in ONE_WORKER]:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}-{shared[0]}"))


def _check_groups(config, items):
    """With --dist loadgroup, a grouped test's node id must end in its group, or the groups are
    ignored and each worker runs every shared fixture (pytest 9.2 with xdist 3.8: pyproject's pin)."""
    if not getattr(config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(f"--dist loadgroup lost the xdist groups of {len(lost)} tests (e.g. {lost[0]}): "
                                f"pytest {pytest.__version__} with this pytest-xdist; install pytest<9.2")
