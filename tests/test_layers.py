"""The shape of the code: no import cycles in the library, its command line or its
benchmarks, type-only imports included; and the relay and the parts of the sender and
the receiver reach into no other object's private members."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Packages checked, as (folder, the name it is imported as).
PACKAGES = (("zmqsync", "zmqsync"), ("cli", "zmqsync_cli"), ("benchmarks", "benchmarks"))

#: The relay, and the parts the sender and the receiver are composed of: each uses the
#: others through their public methods and hooks only.
PARTS = (
    "relay.py",
    "sender/pump.py",
    "sender/stats.py",
    "sender/transfers.py",
    "sender/versions.py",
    "receiver/applying.py",
    "receiver/observer.py",
    "receiver/rejections.py",
    "receiver/session.py",
    "receiver/stats.py",
)


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, name in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported, or that a type checker reads:
    every import outside a function body (at the top, under ``if TYPE_CHECKING:`` or
    any other ``if``, ``try`` or ``with``, in a class body). An import inside a function
    runs only when it is called: that is how a module reaches up lazily."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _import_nodes(child)


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``module`` imports (see :func:`_import_nodes`)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = set()
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            submodules = [f"{base}.{a.name}" for a in node.names]
            # The package itself only where a name comes from its __init__: importing a
            # submodule initialises its package first, as every import of one does.
            names = submodules if all(m in known for m in submodules) else [base, *submodules]
        else:
            names = [a.name for a in node.names]
        out.update(n for n in names if n in known and n != module)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


@pytest.mark.timeout(60)
def test_no_import_cycles_type_only_imports_included() -> None:
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert len(mods) > 100, sorted(mods)  # the walk found the packages
    cycles = _cycles(graph)
    assert not cycles, "import cycles (each import closes one):\n" + "\n".join(
        " -> ".join(c) for c in cycles
    )


@pytest.mark.timeout(60)
def test_the_import_walk_sees_type_only_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import zmqsync.errors\n"
        "if TYPE_CHECKING:\n"
        "    from zmqsync.sender import WeightSender\n"
        "def later():\n"
        "    import zmqsync.relay\n"
    )
    seen = {n for node in _import_nodes(ast.parse(source)) for n in _names(node)}
    assert seen == {"typing", "zmqsync.errors", "zmqsync.sender"}


def _names(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""]
    return [a.name for a in node.names]


def _private_reaches(tree: ast.AST) -> dict[str, list[int]]:
    """Each ``obj._member`` in ``tree`` where ``obj`` is not ``self`` or ``cls``, as the
    source spells it, with the lines it is on. Dunders (``__init__``) are not private."""
    reaches: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        reaches.setdefault(f"{ast.unparse(node.value)}.{node.attr}", []).append(node.lineno)
    return reaches


@pytest.mark.timeout(60)
@pytest.mark.parametrize("part", PARTS)
def test_the_relay_and_each_part_reach_into_no_other_objects_private_members(
    part: str,
) -> None:
    reaches = _private_reaches(ast.parse((ROOT / "zmqsync" / part).read_text()))
    assert not reaches, (
        f"{part} reaches into another object's private members (use a public method or "
        "hook of that object instead):\n"
        + "\n".join(f"  {reach} on lines {lines}" for reach, lines in sorted(reaches.items()))
    )


@pytest.mark.timeout(60)
def test_the_private_reach_walk_tells_self_from_others() -> None:
    source = (
        "class A:\n"
        "    def f(self, other):\n"
        "        self._mine = other._theirs\n"
        "        super().__init__()\n"
        "        return self.sender._cond, WeightReceiver._ack(other), cls._ok\n"
    )
    assert _private_reaches(ast.parse(source)) == {
        "other._theirs": [3],
        "self.sender._cond": [5],
        "WeightReceiver._ack": [5],
    }
