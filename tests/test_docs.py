"""The docs show what the program prints: every marked command example of README.md,
docs/cli.md and docs/large-models.md (benchmarks/docs.py; regenerate with
`python benchmarks/docs.py --write`), and the README's Python example, run as written."""
import os
import re
import subprocess
import sys

import pytest

from benchmarks.docs import DOCS, ROOT, ExampleError, block, examples, find_examples, normalise, rewrite, run_all
from remat.runtime.examples import EXAMPLES

CLI_MD = ROOT / "docs" / "cli.md"
README = ROOT / "README.md"
FOUND = examples(slow=False)
SLOW = [e for e in examples() if e.slow]


# ------------------------------------------------------------------ the machinery (no commands run)
def test_normalise_hides_timings_and_paths_only():
    a = "solver         ilp: optimal, gap 2.0%, 43.21 s\n17 nodes profiled in 1.0 s\nest. 17.3 ms  "
    b = "solver         ilp: optimal, gap 2.0%, 3.5 s\n17 nodes profiled in 12.0 s\nest. 17.3 ms\n\n"
    assert normalise(a) == normalise(b)
    assert normalise(a.replace("17.3 ms", "17.4 ms")) != normalise(b)          # estimates are compared
    assert normalise(a.replace("gap 2.0%", "gap 2.1%")) != normalise(b)
    assert normalise(a.replace("17 nodes", "18 nodes")) != normalise(b)
    assert normalise(f"memory plot: {ROOT}/remat-sweep/memory.png") == "memory plot: remat-sweep/memory.png"


def test_rewrite_writes_the_output_under_each_marker():
    text = ("intro\n<!-- remat-example: remat check a --budget 1GB -->\n```\nstale\n```\nmiddle\n"
            "<!-- remat-example: remat report b --budget 50% -->\n```text\n$ remat report b --budget 50%\n"
            "solver         ilp: optimal, 1.00 s\n```\nend\n")
    outputs = {"remat check a --budget 1GB": "OK: fits  \n",
               "remat report b --budget 50%": "solver         ilp: optimal, 9.99 s\n"}
    new = rewrite(text, outputs.__getitem__)
    assert new == ("intro\n<!-- remat-example: remat check a --budget 1GB -->\n```\n$ remat check a --budget 1GB\n"
                   "OK: fits\n```\nmiddle\n<!-- remat-example: remat report b --budget 50% -->\n```text\n"
                   "$ remat report b --budget 50%\nsolver         ilp: optimal, 1.00 s\n```\nend\n")   # timing kept
    assert rewrite(new, outputs.__getitem__) == new
    assert [(e.line, e.command, e.shown) for e in find_examples(new)] == [
        (2, "remat check a --budget 1GB", "$ remat check a --budget 1GB\nOK: fits"),
        (8, "remat report b --budget 50%", "$ remat report b --budget 50%\nsolver         ilp: optimal, 1.00 s")]
    with pytest.raises(ExampleError, match="followed directly by a fenced block"):
        find_examples("<!-- remat-example: remat check a --budget 1GB -->\ntext\n```\nx\n```\n")
    slow = find_examples("<!-- remat-example-slow: remat report x --budget 1GB -->\n```\nold\n```\n")
    assert [e.slow for e in slow] == [True] and rewrite("<!-- remat-example-slow: remat r -->\n```\nold\n```\n",
                                                       lambda c: "new\n") == ("<!-- remat-example-slow: remat r -->\n"
                                                                              "```\n$ remat r\nnew\n```\n")
    with pytest.raises(ExampleError, match="runs `remat"):
        find_examples("<!-- remat-example: python -c 1 -->\n```\n```\n")


# ------------------------------------------------------------------ what the docs mark
def test_the_docs_mark_their_examples():
    commands = {e.command for e in FOUND}
    assert {e.path for e in FOUND + SLOW} == set(DOCS)
    readme = [e.command for e in FOUND if e.path.name == "README.md"]
    assert any(c.startswith("remat report --budget") for c in readme), readme   # the built-in gpt2's report
    cli = [e.command.split()[1] for e in FOUND if e.path == CLI_MD]
    assert {"report", "check", "sweep"} <= set(cli)
    assert "remat check docs/example_model.py:make --budget 70%" in commands
    assert any(c.startswith("remat sweep") and "--no-plot" in c for c in commands)
    assert sum(c.startswith("remat check") for c in commands) >= 3   # one that fits, one that does not, the factory
    assert any("--hf-config" in e.command and "--optimizer adamw" in e.command for e in SLOW)   # the 7B report
    for e in FOUND + SLOW:
        assert e.shown.splitlines()[0] == f"$ {e.command}", f"{e.where}: the block does not start with its command"
        assert len(e.shown.splitlines()) > 1, f"{e.where}: no output under `{e.command}`"


_COMMAND = re.compile(r"\bremat (?:report|check|sweep) +([^\s`]+)")
_PLACEHOLDERS = {"MODEL", "[MODEL]", "path/to/file.py:factory", "package.module:factory", "models.py:make"}


def test_cli_md_names_models_that_exist():
    """Every MODEL a command in docs/cli.md names is a built-in or a factory that exists (the zoo
    models are factories now: `benchmarks/zoo_models.py:hf_llama`, not `hf-llama`)."""
    named = [m for m in _COMMAND.findall(CLI_MD.read_text()) if not m.startswith("-")]
    assert named
    for model in named:
        if model in EXAMPLES or model in _PLACEHOLDERS:
            continue
        assert ":" in model, f"docs/cli.md: `{model}` is neither a built-in ({', '.join(EXAMPLES)}) nor a factory"
        where, factory = model.rsplit(":", 1)
        path = ROOT / where
        assert path.is_file(), f"docs/cli.md: {where} does not exist"
        assert re.search(rf"^def {re.escape(factory)}\(", path.read_text(), re.M), f"docs/cli.md: no {factory} in {where}"


# ------------------------------------------------------------------ the docs against the program
@pytest.mark.slow
@pytest.mark.parametrize("example", FOUND, ids=[f"{e.path.name}:{e.line}" for e in FOUND])
def test_example_shows_what_the_program_prints(example):
    # one command a test, so that xdist's workers share them out (each command's own solver time
    # limit keeps a busy machine's solve from stopping early: the README's runs at --time-limit 30)
    r = run_all([example.command])[example.command]
    assert normalise(example.shown) == normalise(block(example.command, r.stdout)), (
        f"{example.where} is stale: run `python benchmarks/docs.py --write`")
    assert r.returncode == (1 if r.stdout.startswith("FAIL") else 0), r.stderr
    if "--quiet" in example.command.split():
        assert r.stderr == "", f"`{example.command}` printed on stderr:\n{r.stderr}"


# ------------------------------------------------------------------ the README's Python example
_PYTHON_EXAMPLE = re.compile(r"^<!-- remat-python-example -->\n```python\n(?P<code>.*?)^```\n"
                             r"[^\n]*\n```text\n(?P<prints>.*?)^```", re.M | re.S)


def test_the_readme_python_example_runs_as_written(tmp_path):
    """The README's complete example (under `<!-- remat-python-example -->`), run as a user runs it:
    a fresh process in an empty folder, with the package as installed (`pip install -e .`), no plan
    cache; it prints what the README says it prints (tests/test_package.py runs it from the wheel)."""
    found = _PYTHON_EXAMPLE.findall(README.read_text())
    assert len(found) == 1, "README.md: one `<!-- remat-python-example -->` python block, then its ```text output"
    code, prints = found[0]
    (tmp_path / "example.py").write_text(code)
    env = {**os.environ, "REMAT_CACHE": "0"}
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == prints.strip(), f"README.md's Python example now prints:\n{r.stdout}"
