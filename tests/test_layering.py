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
    return re.findall(r"^  (_[a-z0-9_]+)\.py ", table, flags=re.MULTILINE)


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


# The pieces of a ring pass's protocol (``_ring_driver.py``): beginning a ring, the passenger and the
# rider it takes, the deferred hop, the transport's step loop, the backward's trim, the profiler range.
_RING_PROTOCOL = {
    "ring_begins", "forward_prefetch", "backward_prefetch", "next_first", "ring_rider", "pending_reductions",
    "deferred_hops", "circulate", "trim", "record_function",
}
# Files above the driver that own a pass's lifecycle rather than a ring's: the state begins and ends the
# outermost forward (and its gathers), fusion forgets a pass whose groups changed.
_PASS_OWNERS = {"_state", "_fusion"}


def _names_used(path: Path) -> set[str]:
    """Every attribute and name ``path`` reads or imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.alias):
            found.add(node.name)
    return found


def test_rings_run_only_through_the_driver():
    """Every ring pass goes through the ring driver: no file above it in the layout (the ring layers,
    and what calls them) names a piece of the protocol, and the ring layers reach the model's context
    only through it (no ``layer.state.ring.context`` back-pointers)."""
    order = _layout_order()
    above = order[order.index("_ring_driver") + 1 :]
    found = {}
    for name in above:
        used = _names_used(ENGINE / f"{name}.py")
        hits = sorted(used & _RING_PROTOCOL) + (["context"] if "context" in used and name not in _PASS_OWNERS else [])
        if hits:
            found[name] = hits
    assert found == {}
