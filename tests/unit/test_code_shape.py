"""Size limits of the core library, the launch package and the services, read with `ast`.

No class over 250 lines and no function over 60 lines (docstrings and comments count: a function
that needs a page of explanation is two functions). A file-and-name pair listed in EXCEPTIONS is
allowed past the limit for the reason written next to it.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = (
    "shared/src",
    "services/inference/src",
    "services/orchestrator/src",
    "services/trainer/src",
)
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 60

# "path:name" -> why it may be longer.
EXCEPTIONS: dict[str, str] = {}


def oversized(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            limit = MAX_FUNCTION_LINES
        elif isinstance(node, ast.ClassDef):
            limit = MAX_CLASS_LINES
        else:
            continue
        lines = node.end_lineno - node.lineno + 1
        key = f"{path.relative_to(ROOT)}:{node.name}"
        if lines > limit and key not in EXCEPTIONS:
            found.append(f"{key} ({lines} lines, limit {limit})")
    return found


def checked_files() -> list[Path]:
    return [path for top in CHECKED for path in sorted((ROOT / top).rglob("*.py"))]


def test_no_class_or_function_is_over_its_size_limit():
    assert [problem for path in checked_files() for problem in oversized(path)] == []


def test_the_size_check_sees_a_long_function(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n" + "    x = 1\n" * 61)
    assert oversized(sample) == ["sample.py:f (62 lines, limit 60)"]
