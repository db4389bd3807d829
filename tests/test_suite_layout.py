"""The test suite's own layout: no test module imports another (or conftest.py).

What tests share -- helpers, models, workloads, fixtures -- lives in tests/support/ (or, for fixtures every
module may use, in conftest.py, which pytest loads itself). A test module imported by another ties the importer
to names the other file may rename or drop, and runs the other's imports and module-level set-up for it;
support modules import no test module either.
"""

from __future__ import annotations

import ast
import glob
import os

TESTS = os.path.dirname(os.path.abspath(__file__))


def forbidden_imports(path: str) -> list[str]:
    """``file:line: module`` for each import, at any depth (in a function too), of a ``test_*`` module or of
    ``conftest`` in the Python file at ``path``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top.startswith("test_") or top == "conftest":
                found.append(f"{os.path.relpath(path, TESTS)}:{node.lineno}: {name}")
    return found


def test_no_test_module_imports_another():
    files = sorted(glob.glob(os.path.join(TESTS, "test_*.py")) + glob.glob(os.path.join(TESTS, "support", "*.py")))
    assert len(files) > 50  # the glob found the suite
    bad = [hit for path in files for hit in forbidden_imports(path)]
    assert not bad, "move what is shared to tests/support/:\n" + "\n".join(bad)


def test_the_check_catches_an_import(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text("import os\nfrom support import crash_states\nfrom test_codecs import roundtrip\n\n"
                    "def test_y():\n    import test_remote as r\n    from conftest import s3_options\n")
    assert [hit.split(": ")[1] for hit in forbidden_imports(str(path))] == ["test_codecs", "test_remote", "conftest"]
