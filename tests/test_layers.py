"""The shape of the code: no import cycles in the library, its command line or its
benchmarks, and no module of the library over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Packages checked, as (folder, the name it is imported as).
PACKAGES = (("zmqsync", "zmqsync"), ("cli", "zmqsync_cli"), ("benchmarks", "benchmarks"))
#: The most lines a library module may have: one idea each.
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, name in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``module`` imports when it is imported (its
    top-level imports, not those under ``if TYPE_CHECKING:`` or inside functions)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(n for n in names if n in known and n != module)
    return out


def test_no_import_cycles() -> None:
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
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
    assert len(mods) > 100, sorted(mods)  # the walk found the packages
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_library_module_is_much_over_five_hundred_lines() -> None:
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for p in (ROOT / "zmqsync").rglob("*.py")
    }
    assert len(sizes) > 50
    too_long = {p: n for p, n in sizes.items() if n > MAX_LINES}
    assert not too_long, too_long
