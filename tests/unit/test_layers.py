"""The package's import graph: no cycle between modules, and no import from a lower layer into a
higher one. The layer order is the one docs/architecture.md states; read with ``ast``, nothing runs.
Every import counts, also the lazy ones inside functions and those under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_rl"

# Exempted cycles, each exactly as found (a set of modules): none. A new cycle fails.
EXEMPT_CYCLES: list[set[str]] = []


def layers() -> list[str]:
    """The order in docs/architecture.md: the line ``Layers, bottom to top: a, b, c``."""
    text = (REPO / "docs" / "architecture.md").read_text()
    m = re.search(r"^Layers, bottom to top: (.+)$", text, re.M)
    assert m, "docs/architecture.md has no line 'Layers, bottom to top: ...'"
    return [name.strip(" `") for name in m.group(1).split(",")]


def modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        name = ".".join(p.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that module ``name`` imports (absolute and relative imports)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            # the deepest known module the target names (``a.b.c`` may be attribute c of module a.b)
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + ".") and not t.startswith(name + "."):
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def strongly_connected(g: dict[str, set[str]]) -> list[set[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str) -> str:
    return module.split(".")[1]


def test_every_package_has_a_layer():
    order = layers()
    assert len(set(order)) == len(order), f"a layer is listed twice: {order}"
    tops = {layer_of(m) for m in modules() if m != "megatron_rl"}
    assert tops - set(order) == set(), \
        f"packages / modules without a layer in docs/architecture.md: {sorted(tops - set(order))}"
    assert set(order) - tops == set(), f"layers that do not exist: {sorted(set(order) - tops)}"


def test_no_import_runs_up_the_layers():
    rank = {name: i for i, name in enumerate(layers())}
    upward = sorted(f"{a} imports {b}" for a, targets in graph().items() for b in targets
                    if a != "megatron_rl" and rank[layer_of(b)] > rank[layer_of(a)])
    assert not upward, "imports from a lower layer into a higher one:\n" + "\n".join(upward)


def test_no_import_cycle():
    cycles = strongly_connected(graph())
    new = [sorted(c) for c in cycles if c not in EXEMPT_CYCLES]
    assert not new, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in new)
    stale = [sorted(c) for c in EXEMPT_CYCLES if c not in cycles]
    assert not stale, f"exempted cycles that no longer exist (delete them from EXEMPT_CYCLES): {stale}"


def test_the_checker_sees_what_it_must():
    """The graph reader itself: relative imports, lazy imports and attribute imports resolve."""
    g = graph()
    assert "megatron_rl.ops.stats" in g["megatron_rl.ops.torch_backend"]  # `from .stats import ...`
    assert "megatron_rl.sync.base" in g["megatron_rl.trainer.context"]  # lazy, inside a function
    assert "megatron_rl.trainer.schema" in g["megatron_rl.trainer.context"]  # under TYPE_CHECKING
    assert "megatron_rl.models.gpt" in g["megatron_rl.models.forward"]  # `from megatron_rl.models import gpt`
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
