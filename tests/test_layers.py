"""The floors of architecture.md: a module imports only from its package or from lower floors."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "swarm"

# floor -> the top-level units on it (a unit is a module of swarm/ or a subpackage)
FLOORS: dict[int, tuple[str, ...]] = {
    0: ("errors",),
    1: (
        "version",
        "address",
        "strict_msgpack",
        "hosts",
        "options",
        "refusal_log",
        "round_schedule",
        "choices",
        "timeouts",
        "lru",
    ),  # import nothing of swarm but errors
    2: ("identity",),
    3: ("auth",),
    4: ("compression", "net", "dht", "peer_config"),
    5: ("monitor", "protocols", "peer_flags"),
    6: ("peer", "config"),
    7: ("averaging", "training", "dashboard", "config_sources"),
    8: ("api", "cli"),
    9: ("optim", "distributed", "__main__"),  # built on api; the guarded entry point
}
FLOOR_OF = {unit: floor for floor, units in FLOORS.items() for unit in units}


def _unit(module: str) -> str | None:
    """``swarm.net.record`` -> ``net``; the package root -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every swarm import in a file, lazy ones inside functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "swarm":
            names = [f"swarm.{alias.name}" for alias in node.names]  # from swarm import x
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.split(".")[0] == "swarm"]
    return found


def _library_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


def test_every_unit_has_a_floor() -> None:
    units = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in _library_files()}
    assert units - set(FLOOR_OF) == set()


@pytest.mark.parametrize("path", _library_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_go_down(path: Path) -> None:
    own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    wrong = []
    for line, module in _imports(path):
        target = _unit(module)
        if target is None:
            wrong.append(f"line {line}: imports the package root (use swarm.version and friends)")
        elif target != own and FLOOR_OF[target] >= FLOOR_OF[own]:
            wrong.append(f"line {line}: {own} (floor {FLOOR_OF[own]}) imports {module}")
    assert wrong == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import swarm\nfrom swarm import dht\ndef f():\n    from swarm.net import record\n",
        encoding="utf-8",
    )
    assert _imports(sample) == [(1, "swarm"), (2, "swarm.dht"), (4, "swarm.net")]


def _module_graph() -> dict[str, set[str]]:
    """Module -> the swarm modules it imports (``from swarm.pkg import module`` resolved)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in names else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def test_no_import_cycles_lazy_imports_included() -> None:
    graph = _module_graph()
    assert "swarm.compression.codecs" in graph["swarm.compression"]
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_helper_peer_does_not_import_torch() -> None:
    """``swarm-peer`` trains nothing: importing its CLI must not load torch (about 200 MB of
    resident memory on a bootstrap node)."""
    import subprocess
    import sys

    code = "import sys, swarm.cli; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent).returncode == 0
