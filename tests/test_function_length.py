"""Small functions (issue 43, item 6): no function or method in planner/ or runtime/ is longer than
60 lines (its def to its last line, docstring included)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 60


def test_no_function_is_longer_than_60_lines():
    long = []
    for path in sorted([*(ROOT / "planner").rglob("*.py"), *(ROOT / "runtime").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LIMIT:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)
