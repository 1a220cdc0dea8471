"""The docs show what the program prints: every marked command example of README.md,
docs/cli.md and docs/large-models.md (benchmarks/docs.py; regenerate with
`python benchmarks/docs.py --write`), and the README's Python example, run as written. The API
reference (docs/api.md) documents what users import, as they spell it, every field and method
from its docstring; the site links its own pages."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.slow            # a fresh process planning GPT-2 (6 s); the quick lane plans small models in process
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


# ------------------------------------------------------------------ the API reference (issue 41)
API_MD = ROOT / "docs" / "api.md"
INDEX_MD = ROOT / "docs" / "index.md"
# what `model.remat` offers a user (runtime.api.Remat), each on the API page
REMAT_MEMBERS = ("plan", "plans", "solves", "plan_for", "use_plan", "time_plan", "set_loss_fn", "remove")


def _subpackage_spellings(text: str) -> list[str]:
    """The names `remat` exports, spelled through its subpackages (`runtime.remove(model)`,
    `planner.plan`, `remat.runtime.testing.assert_fits`, `from remat.planner import Plan`) rather
    than as users import them (`remat.remove`)."""
    import remat
    names = "|".join(sorted(remat._EXPORTS, key=len, reverse=True))
    dotted = re.compile(rf"(?<![\w/.])(?:remat\.)?(?:runtime|planner)(?:\.\w+)*?\.(?:{names})\b")
    imports = re.compile(r"\bfrom\s+(?:remat\.)?(?:runtime|planner)\b[\w.]*\s+import\s+\(?([\w ,]+)")
    found = [m.group(0) for m in dotted.finditer(text)]
    found += [m.group(0) for m in imports.finditer(text)
              if {n.strip() for n in m.group(1).split(",")} & set(remat._EXPORTS)]
    return found


def test_the_spelling_check_finds_subpackage_spellings():
    text = ("`runtime.remove(model)`; `planner.plan(m, 2.5)`; `runtime.testing.assert_fits(m, x, 24)`;\n"
            "`remat.runtime.api.plan_and_wrap`; from remat.planner import PlanOptions, Plan\n")
    assert _subpackage_spellings(text) == ["runtime.remove", "planner.plan", "runtime.testing.assert_fits",
                                           "remat.runtime.api.plan_and_wrap", "from remat.planner import PlanOptions, Plan"]
    fine = ("`remat.remove(model)`, `remat.plan`, `from remat import assert_fits`, `planner/api.py`, "
            "`planner.solve.fit.reuse_plan`, `runtime.rewrite.plan_modules`, `model.remat.plan`, `planner.step.storage`")
    assert _subpackage_spellings(fine) == []


@pytest.mark.parametrize("path", sorted((ROOT / "docs").glob("*.md")) + [README], ids=lambda p: p.name)
def test_the_docs_spell_the_api_as_users_import_it(path):
    """One spelling of the public API in the docs: `remat.plan_and_wrap`, `from remat import ...`
    (the names the package exports; internals such as `planner.solve.fit.reuse_plan` may be named)."""
    assert _subpackage_spellings(path.read_text()) == [], f"{path.name}: spell these as remat.<name>"


def test_the_api_page_documents_names_users_import():
    directives = re.findall(r"^::: (\S+)", API_MD.read_text(), re.M)
    assert directives and all(d.startswith("remat.") and d.count(".") == 1 for d in directives), directives
    for must in ("remat.plan_and_wrap", "remat.apply", "remat.remove", "remat.plan", "remat.Remat", "remat.PlanOptions",
                 "remat.SolveOptions", "remat.Plan", "remat.Region", "remat.peak_memory", "remat.assert_fits"):
        assert must in directives, must


def _field_docstrings(path: Path, cls: str) -> dict[str, str | None]:
    """Each annotated field of class `cls` in `path`, with the string literal right under it."""
    tree = ast.parse(path.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    out = {}
    for stmt, after in zip(body, body[1:] + [None]):
        if isinstance(stmt, ast.AnnAssign):
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
            out[stmt.target.id] = doc
    return out


@pytest.mark.parametrize("where, cls", [("planner/options.py", "PlanOptions"), ("planner/options.py", "SolveOptions"),
                                        ("planner/result.py", "Plan"), ("planner/result.py", "Region")])
def test_every_option_and_plan_field_has_a_docstring(where, cls):
    """Fields are documented by a string under each (the API page renders it), not a `#` comment."""
    import dataclasses
    import remat
    docs = _field_docstrings(ROOT / where, cls)
    assert set(docs) == {f.name for f in dataclasses.fields(getattr(remat, cls))}
    assert not [name for name, doc in docs.items() if not (doc or "").strip()], f"{cls}: fields without a docstring"


def test_the_home_page_links_to_the_built_pages():
    """docs/index.md is the README; every README link to a page under docs/ (github.com, for
    GitHub and PyPI) is defined again in index.md as the page itself, which the site builds."""
    readme = dict(re.findall(r"^\[([\w-]+)\]: https://github\.com/remat-dev/remat/blob/main/docs/(\S+)$",
                             README.read_text(), re.M))
    index = dict(re.findall(r"^\[([\w-]+)\]: (\S+)$", INDEX_MD.read_text(), re.M))
    assert readme and INDEX_MD.read_text().startswith('--8<-- "README.md"')
    assert {k: index.get(k) for k in readme} == readme


def test_one_default_ilp_time_limit():
    """The ILP's time limit has one default, SolveOptions.time_limit_s: plan_and_wrap, the CLI's
    --time-limit and assert_fits take it."""
    import inspect
    from remat import SolveOptions, assert_fits
    from remat.runtime.cli.main import parser
    default = SolveOptions().time_limit_s
    assert parser().parse_args(["report", "--budget", "1GB"]).time_limit == default
    assert inspect.signature(assert_fits).parameters["time_limit_s"].default == default


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The docs site, built as CI builds it: the `mkdocs` console script, --strict."""
    out = tmp_path_factory.mktemp("site")
    script = Path(sys.executable).parent / "mkdocs"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "mkdocs"]
    r = subprocess.run(cmd + ["build", "--strict", "-d", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return out


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html).replace("&gt;", ">").replace("&lt;", "<").replace("&amp;", "&")


@pytest.mark.slow
@pytest.mark.xdist_group("docs_site")
def test_the_api_page_documents_every_field_and_method(site):
    import dataclasses
    import remat
    html = (site / "api" / "index.html").read_text()
    ids = set(re.findall(r'\bid="(remat\.[\w.]+)"', html))
    want = {f"remat.{cls}.{f.name}" for cls in ("PlanOptions", "SolveOptions", "Plan", "Region")
            for f in dataclasses.fields(getattr(remat, cls))}
    want |= {f"remat.Plan.{m}" for m in ("extra_compute_pct", "to_json", "from_json", "summary")}
    want |= {f"remat.Remat.{m}" for m in REMAT_MEMBERS}
    want |= {"remat.peak_memory", "remat.plan_and_wrap", "remat.apply", "remat.remove", "remat.plan", "remat.assert_fits"}
    assert not want - ids, f"not on the API page: {sorted(want - ids)}"
    for m in REMAT_MEMBERS:        # each with its docstring: a paragraph before the next heading
        part = html[html.index(f'id="remat.Remat.{m}"') + 1:]
        part = part[:part.index(' id="remat.')]
        assert "<p>" in part, f"remat.Remat.{m} is on the API page without a docstring"


@pytest.mark.slow
@pytest.mark.xdist_group("docs_site")
def test_the_api_page_renders_examples_as_code(site):
    """A docstring's `>>>` example renders as code with its prompts, never as a (nested)
    blockquote, which is what Markdown makes of `>>>` outside an `Examples:` section."""
    import inspect
    import remat
    html = (site / "api" / "index.html").read_text()
    assert "<blockquote>" not in html
    names = re.findall(r"^::: remat\.(\w+)", API_MD.read_text(), re.M)
    prompts = sum(line.lstrip().startswith(">>>") for n in names
                  for line in (inspect.getdoc(getattr(remat, n)) or "").splitlines())
    assert prompts >= 5
    assert html.count('<span class="gp">&gt;&gt;&gt; </span>') >= prompts


@pytest.mark.slow
@pytest.mark.xdist_group("docs_site")
def test_the_built_site_links_and_spells_as_users_import(site):
    index = (site / "index.html").read_text()
    assert "github.com/remat-dev/remat/blob/main/docs/" not in index
    for page in ("budget/", "cli/", "api/", "limits/", "testing/"):
        assert f'href="{page}"' in index, page
    api = _text((site / "api" / "index.html").read_text())
    assert _subpackage_spellings(api) == [], "the API page's docstrings spell names through subpackages"
    from remat import SolveOptions      # the ILP's default time limit: stated there, linked from the guides
    assert f"{SolveOptions().time_limit_s:g} s by default" in api
    for page in ("cli", "limits"):
        assert 'href="../api/#remat.SolveOptions.time_limit_s"' in (site / page / "index.html").read_text(), page


def test_the_type_checking_imports_are_the_exports():
    """remat/__init__.py names each export under TYPE_CHECKING where it is defined (type checkers,
    and griffe when it reads the package from source): the same names as its lazy `_EXPORTS`."""
    import remat
    tree = ast.parse((ROOT / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    imported = [a.asname or a.name for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names]
    assert sorted(imported) == sorted(remat._EXPORTS)
    for n in block.body:         # each from the subpackage `_EXPORTS` says
        for a in n.names:
            assert n.module.split(".")[0] == remat._EXPORTS[a.name], (n.module, a.name)
