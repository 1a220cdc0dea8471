"""benchmarks/results holds the current file of each benchmark, each cited from README.md, docs/ or
the benchmark scripts, and HISTORY.md (earlier runs' headline numbers); every results file the
README or the docs cite exists. A superseded run is read with `git show COMMIT:benchmarks/results/NAME`
(HISTORY.md names the commit), or linked pinned to a commit (`.../blob/<sha>/benchmarks/results/...`),
never at main."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

# A results path, bare or in a link to the repository; a link pinned to a commit (not main) is history.
CITE = re.compile(r"(?:github\.com/remat-dev/remat/(?:blob|raw)/(?P<ref>[^/\s)]+)/)?"
                  r"benchmarks/results/(?P<name>[\w.-]+)")
# fuzz.md is the fuzzer's next run, being written while its citation (docs/testing.md) already
# points at it: cited before it exists. Every other cited file must exist.
NOT_YET_WRITTEN = {"fuzz.md"}


def cited(paths: list[Path]) -> dict[str, list[str]]:
    """{file name: [where cited]} for the results files `paths` name at main."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for m in CITE.finditer(line):
                if m["ref"] not in (None, "main"):
                    continue
                found.setdefault(m["name"].rstrip("."), []).append(f"{path.relative_to(ROOT)}:{i}")
    return found


def companions(name: str) -> set[str]:
    """What a cited results file brings with it: its .json beside a .md, and the files it links."""
    path = RESULTS / name
    if path.suffix != ".md" or not path.exists():
        return set()
    linked = re.findall(r"\]\(([\w.-]+)(?:#[\w-]*)?\)", path.read_text())
    return {path.with_suffix(".json").name, *linked}


def test_the_citation_pattern():
    text = ("[a](https://github.com/remat-dev/remat/blob/main/benchmarks/results/plan-time.md) "
            "![b](https://github.com/remat-dev/remat/raw/3b15c69/benchmarks/results/2026-11-30-vm-gpt2.png) "
            "benchmarks/results/HISTORY.md (plan-time) and benchmarks/results/gpu.md.")
    names = [(m["ref"], m["name"].rstrip(".")) for m in CITE.finditer(text)]
    assert names == [("main", "plan-time.md"), ("3b15c69", "2026-11-30-vm-gpt2.png"),
                     (None, "HISTORY.md"), (None, "gpu.md")]


def test_every_results_file_is_cited():
    where = cited(DOCS + SCRIPTS)
    reached = set(where)
    for name in list(where):
        reached |= companions(name)
    files = {p.name for p in RESULTS.iterdir() if p.is_file()}
    uncited = sorted(files - reached - {"HISTORY.md"})
    assert not uncited, (f"{uncited}: cited nowhere in README.md, docs/ or benchmarks/*.py. Cite the current "
                         "file of a benchmark from the docs; a superseded run goes: its headline to "
                         "benchmarks/results/HISTORY.md, the file `git rm`ed")


def test_every_results_file_the_docs_cite_exists():
    missing = {name: where for name, where in cited(DOCS).items()
               if not (RESULTS / name).exists() and name not in NOT_YET_WRITTEN}
    assert not missing, (f"cited but not in benchmarks/results: {missing}. A superseded run is in "
                         "benchmarks/results/HISTORY.md: cite that, or link the file pinned to a commit")


def test_history_has_a_table_per_benchmark_with_a_current_file():
    history = (RESULTS / "HISTORY.md").read_text()
    for section in ("step-time", "plan-time", "scale", "zoo", "distributed", "fuzz"):
        assert f"\n## {section}\n" in history, section
    for name in re.findall(r"\[[^\]]*\]\(([\w.-]+\.(?:md|json))(?:#[\w-]*)?\)", history):
        assert (RESULTS / name).exists(), f"HISTORY.md links {name}, which is not in benchmarks/results"
