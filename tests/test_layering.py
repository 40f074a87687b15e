"""The engine's files are layered, and the docs say so: a static check of imports and names (no ranks).

docs/design.md's layout table lists the files of ``rsdp/_fully_shard/`` lowest first, and a file may
import only files listed above it. Private torch names are imported or called only in
``rsdp/_compat.py``.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "rsdp" / "_fully_shard"


def _layout_order() -> list[str]:
    """The engine's files in the order docs/design.md's layout table lists them."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text[text.index("rsdp/_fully_shard/  the engine") : text.index("rsdp/planner/")]
    return re.findall(r"^  (_[a-z_]+)\.py ", table, flags=re.MULTILINE)


def _engine_imports(path: Path) -> set[str]:
    """The engine modules ``path`` imports (``from ._x import ...``), at module level or in a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {alias.name for alias in node.names}
    return found


def test_the_layout_table_lists_every_engine_file_once():
    order = _layout_order()
    files = sorted(path.stem for path in ENGINE.glob("*.py") if path.stem != "__init__")
    assert sorted(order) == files


def test_no_engine_file_imports_a_file_listed_below_it():
    order = _layout_order()
    upward = {
        path.stem: sorted(imported for imported in _engine_imports(path) if order.index(imported) >= order.index(path.stem))
        for path in ENGINE.glob("*.py")
        if path.stem != "__init__"
    }
    assert {name: found for name, found in upward.items() if found} == {}


def test_private_torch_names_are_used_only_in_compat():
    private = re.compile(r"\btorch(\.[A-Za-z]\w*)*\._[A-Za-z]\w*|^\s*from torch[\w.]* import .*\b_[a-z]", re.MULTILINE)
    found = {}
    for path in sorted((ROOT / "rsdp").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if name == "rsdp/_compat.py":
            continue
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        code = re.sub(r'"""[\s\S]*?"""', "", code)  # docstrings may name them
        hits = [match.group(0).strip() for match in private.finditer(code)]
        if hits:
            found[name] = hits
    assert found == {}
