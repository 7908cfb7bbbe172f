"""The package's layout rules (docs/architecture.md, "Layout and dependency rules"): no import cycle
among Eyas's owners (``eyas/<owner>/`` and its top-level modules), and the lower layers import only
what the rules allow. Every ``import`` counts, a lazy one inside a function included; an import
under ``if TYPE_CHECKING:`` (a type for annotations only) does not."""

from __future__ import annotations

import ast
from pathlib import Path

EYAS = Path(__file__).resolve().parents[1] / "eyas"
GENERATED = ("eyas_pb2.py", "eyas_pb2_grpc.py")
# an owner -> the owners it may import (the lower layers of docs/architecture.md)
ALLOWED = {
    "cache": set(),
    "compute": set(),
    "protocol": set(),
    "kernels": {"cache"},
    "scheduler": set(),
    "target": {"protocol", "kernels", "cache", "compute"},
    "verification": {"protocol"},
    "drafting": {"protocol", "target", "compute"},
    "training": {"protocol", "target", "drafting", "compute"},
    "learning": {"protocol", "target", "drafting", "training", "compute"},
}


def _owner(path: Path) -> str:
    rel = path.relative_to(EYAS)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _type_checking_imports(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            out |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def import_graph() -> dict[str, set[str]]:
    """owner -> the other owners it imports."""
    edges: dict[str, set[str]] = {}
    for path in EYAS.rglob("*.py"):
        if path.name in GENERATED:
            continue
        src = _owner(path)
        tree = ast.parse(path.read_text())
        skip = _type_checking_imports(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "eyas":
                names = [node.module] if node.module != "eyas" else [f"eyas.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "eyas"]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if len(parts) > 1 and parts[1] != src:
                    edges.setdefault(src, set()).add(parts[1])
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one owner (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def test_the_owners_import_one_another_without_a_cycle():
    assert cycles(import_graph()) == []


def test_the_lower_layers_import_only_what_the_rules_allow():
    edges = import_graph()
    wrong = {owner: sorted(edges.get(owner, set()) - allowed) for owner, allowed in ALLOWED.items()}
    assert not any(wrong.values()), {k: v for k, v in wrong.items() if v}


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
