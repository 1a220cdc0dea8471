"""Private torch APIs only through planner/compat.py (issue 43, item 5): a torch upgrade that moves
one breaks there, at import, with its name. The one exception, FSDP2's private state, is read in
runtime/distributed/fsdp.py alone (compat.py's docstring). Comments and strings do not count."""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"planner/compat.py", "runtime/distributed/fsdp.py"}
# a private module or name of torch: torch._C, torch.utils._pytree; `from torch.x import _name`
PRIVATE = re.compile(r"\btorch(\.[A-Za-z]\w*)*\._[A-Za-z]\w*")
IMPORT = re.compile(r"from torch[\w.]* import (\([^)]*\)|[^\n]*)")


def _private(code: str) -> list[str]:
    found = [m.group(0) for m in PRIVATE.finditer(code)]
    return found + [m.group(0) for m in IMPORT.finditer(code) if re.search(r"(^|[\s(,])_[A-Za-z]", m.group(1))]


def _code(path: Path) -> str:
    """The file's source without comments and string literals (docstrings among them)."""
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    kept = [t.string if t.type not in (tokenize.COMMENT, tokenize.STRING) else '""' for t in toks]
    return " ".join(kept)


def test_private_torch_apis_only_through_compat():
    found = []
    for path in sorted((ROOT / "planner").rglob("*.py")) + sorted((ROOT / "runtime").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        code = re.sub(r"torch \. ops \. \w+ \. \w+", "", _code(path))      # an op's name is not an API
        code = re.sub(r" ?\. ?", ".", code)
        found += [f"{rel}: {x}" for x in _private(code)]
    assert not found, "private torch APIs outside planner/compat.py:\n" + "\n".join(found)


def test_the_check_finds_one():
    assert _private("from torch.utils import _pytree as pytree")
    assert _private("from torch.utils.checkpoint import (checkpoint,\n _CachedTorchDispatchMode)")
    assert _private("x = torch._C._get_dispatch_mode(k)")
    assert not _private("torch.utils.checkpoint.checkpoint(fn)\nfrom torch.fx import Graph\n_x = 1")
