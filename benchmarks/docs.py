"""Command examples in the docs that come from the program.

    python benchmarks/docs.py            # run every marked example, show where the docs differ (exit 1)
    python benchmarks/docs.py --write    # run them and write their real output into the docs
    python benchmarks/docs.py --list     # the marked examples, without running them
    python benchmarks/docs.py --fast     # only the examples the tests check (no `remat-example-slow`)

A marked example is an HTML comment on a line of its own, directly above a fenced block:

    <!-- remat-example: remat check resnet --budget 18MB -->
    ```
    $ remat check resnet --budget 18MB
    OK: predicted peak 17.59 MB <= budget 18.00 MB, 2 regions, extra compute 17.3%
    ```

An example that takes minutes (the Llama-2-7B report) is marked `remat-example-slow` instead:
this script runs and writes it like the others, tests/test_docs.py checks only its form.

The block is the command after `$ `, then what the command prints on stdout (its results;
progress goes to stderr and is not shown). Markdown renders the comment as nothing. Each command
is run once (the same command in two files is run once), as a user runs it: a subprocess of the
`remat` script of this Python's environment, in the repository root, with this checkout's code
first on PYTHONPATH. A command that exits with anything but 0 (fits) or 1 (does not fit) is a
broken example and stops the run.

`normalise` is what may differ between two runs of the same command and is not compared: solve
and profile times ("43.21 s") and the repository's absolute path. tests/test_docs.py compares the
docs with the program through the same functions.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", ROOT / "docs" / "cli.md", ROOT / "docs" / "large-models.md")
MARKER = "remat-example"
SLOW = "-slow"       # MARKER + SLOW: regenerated here, not run by the tests

# the marker, the fence that opens the block under it, the block's body, the closing fence
_EXAMPLE = re.compile(r"^<!-- " + MARKER + r"(?P<slow>" + SLOW + r")?: (?P<command>[^\n]*?) -->[ \t]*\n"
                      r"(?P<fence>```[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
_MARKER_LINE = re.compile(r"^<!-- " + MARKER + r"(?:" + SLOW + r")?:", re.M)
_SECONDS = re.compile(r"\b\d+(?:\.\d+)? s\b")          # "43.21 s", "1.0 s"; not "17.3 ms"


@dataclass(frozen=True)
class Example:
    path: Path
    line: int          # of the marker, 1-based
    command: str       # as written in the marker
    shown: str         # the block's body as the docs have it (no trailing newline)
    slow: bool = False  # marked MARKER + SLOW: not run by the tests

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


@dataclass(frozen=True)
class Run:
    command: str
    returncode: int
    stdout: str
    stderr: str


class ExampleError(Exception):
    """A marker without its block, or a command that is not a `remat` command or that failed."""


# ----------------------------------------------------------------------------- the docs
def find_examples(text: str, path: Path = Path("<text>")) -> list[Example]:
    """The marked examples of one Markdown text, in order. Raises ExampleError for a marker
    that is not directly followed by a fenced block."""
    found = [Example(path, text.count("\n", 0, m.start()) + 1, m["command"].strip(), m["body"].rstrip("\n"),
                     bool(m["slow"])) for m in _EXAMPLE.finditer(text)]
    lines = {e.line for e in found}
    for m in _MARKER_LINE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        if line not in lines:
            raise ExampleError(f"{path}:{line}: a {MARKER} marker must be followed directly by a fenced block")
    for e in found:
        argv(e.command)
    return found


def examples(paths=DOCS, slow: bool = True) -> list[Example]:
    """Every marked example of the docs (without the slow ones, `slow` False)."""
    return [e for p in paths for e in find_examples(Path(p).read_text(), Path(p)) if slow or not e.slow]


def block(command: str, stdout: str) -> str:
    """The body of an example's block: `$ command`, then its stdout."""
    return "\n".join([f"$ {command}"] + [line.rstrip() for line in stdout.rstrip("\n").splitlines()])


def rewrite(text: str, output) -> str:
    """`text` with each marked block's body replaced by `block(command, output(command))`, where
    `output(command)` is its stdout; a block that already shows it (normalised) is left as it is,
    so rewriting does not churn the timings."""
    def body(m: re.Match) -> str:
        command = m["command"].strip()
        real = block(command, output(command))
        if normalise(real) == normalise(m["body"]):
            real = m["body"].rstrip("\n")
        return f"<!-- {MARKER}{m['slow'] or ''}: {command} -->\n{m['fence']}\n{real}\n```"
    return _EXAMPLE.sub(body, text)


def normalise(text: str) -> str:
    """What legitimately varies between runs, made equal: timings in seconds ("0.93 s" -> "<t> s"),
    this checkout's absolute path, trailing spaces and blank lines."""
    text = text.replace(str(ROOT) + os.sep, "").replace(str(ROOT), ".")
    text = _SECONDS.sub("<t> s", text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


# ----------------------------------------------------------------------------- running
def argv(command: str) -> list[str]:
    """The argument list of a `remat ...` example (the program is `remat_program()`)."""
    words = shlex.split(command)
    if not words or words[0] != "remat":
        raise ExampleError(f"{command!r}: an example runs `remat ...`")
    return words[1:]


def remat_program() -> list[str]:
    """The `remat` console script beside this Python, else `python -m remat` (the same program)."""
    script = Path(sys.executable).with_name("remat")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "remat"]


def run(command: str, timeout_s: float = 600) -> Run:
    """Run one example as a user does, from the repository root, with this checkout's code."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    r = subprocess.run(remat_program() + argv(command), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout_s)
    return Run(command, r.returncode, r.stdout, r.stderr)


def run_all(commands, jobs: int = 1) -> dict[str, Run]:
    """Each distinct command run once (`jobs` at a time). Raises ExampleError for a command that
    exits with anything but 0 or 1, with what it printed on stderr."""
    distinct = list(dict.fromkeys(commands))
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        runs = dict(zip(distinct, pool.map(run, distinct)))
    for r in runs.values():
        if r.returncode not in (0, 1):
            raise ExampleError(f"`{r.command}` exited {r.returncode}:\n{r.stderr.strip()}")
    return runs


def differences(found: list[Example], runs: dict[str, Run]) -> list[str]:
    """A unified diff (normalised) for each example whose block is not what its command prints."""
    out = []
    for e in found:
        shown, real = normalise(e.shown), normalise(block(e.command, runs[e.command].stdout))
        if shown != real:
            out.append("\n".join(difflib.unified_diff(shown.splitlines(), real.splitlines(),
                                                      f"{e.where} (the docs)", f"`{e.command}` (the program)",
                                                      lineterm="")))
    return out


def main(args: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the marked command examples of the docs; "
                                             "compare them with the docs, or write them in.")
    ap.add_argument("--write", action="store_true", help="write the real outputs into the docs")
    ap.add_argument("--list", action="store_true", help="list the marked examples, run nothing")
    ap.add_argument("--fast", action="store_true", help="skip the slow examples (those the tests skip)")
    ap.add_argument("--jobs", type=int, default=1, help="commands run at once (default 1)")
    ap.add_argument("files", nargs="*", type=Path, help=f"Markdown files (default: {' '.join(str(p.relative_to(ROOT)) for p in DOCS)})")
    a = ap.parse_args(args)
    paths = [p.resolve() for p in a.files] or list(DOCS)
    try:
        found = examples(paths, slow=not a.fast)
        if a.list:
            for e in found:
                print(f"{e.where}: {e.command}")
            return 0
        for k, command in enumerate(dict.fromkeys(e.command for e in found)):
            print(f"[{k + 1}] {command}", file=sys.stderr)
        runs = run_all([e.command for e in found], a.jobs)
    except ExampleError as e:
        print(f"docs: error: {e}", file=sys.stderr)
        return 2
    if a.write:
        for p in paths:
            text = p.read_text()
            new = rewrite(text, lambda command: runs[command].stdout)
            if new != text:
                p.write_text(new)
                print(f"wrote {p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}", file=sys.stderr)
        return 0
    diffs = differences(found, runs)
    print("\n\n".join(diffs) if diffs else f"{len(found)} examples match the program")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
