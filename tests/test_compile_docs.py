"""docs/compile.md shows benchmarks/compile.py's output: its two tables are the results file's
(benchmarks/results/compile.md), byte for byte. Reads files only."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "compile.md"
RESULTS = ROOT / "benchmarks" / "results" / "compile.md"
SECTIONS = ("## Accuracy", "## Strategies at equal measured peak")


def _section(text: str, heading: str) -> str:
    """`text` from the line `heading` to the next heading of its level or above."""
    at = text.index("\n" + heading + "\n")
    ends = [i for i in (text.find("\n## ", at + 1), text.find("\n# ", at + 1)) if i >= 0]
    return text[at:min(ends) if ends else len(text)]


def _table(text: str) -> list[str]:
    """The markdown table rows of `text`, in order."""
    return [line for line in text.splitlines() if line.startswith("|")]


def test_the_section_reader_stops_at_the_next_heading():
    text = "# t\n## A\n| a |\n|---|\n| 1 |\nprose\n## B\n| b |\n"
    assert _table(_section(text, "## A")) == ["| a |", "|---|", "| 1 |"]
    assert _table(_section(text, "## B")) == ["| b |"]


def test_the_docs_tables_are_the_benchmarks_current_file():
    docs, results = DOCS.read_text(), RESULTS.read_text()
    for heading in SECTIONS:
        shown, measured = _table(_section(docs, heading)), _table(_section(results, heading))
        assert len(measured) > 3, heading                       # a header, its rule and rows
        assert shown == measured, heading
