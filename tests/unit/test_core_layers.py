"""Import layers of the core library, the launch package and the services, read with `ast`.

The core (`shared/src/rlbus`) is a stack of layers; a module may import only from its own unit or
a strictly lower layer (docs/architecture.md, "Layers"):

    0  wire, netutil, docstrings, secrets, process_marks, broadcast (torch), envindex, placement
    1  checksums, rundirs
    2  configs
    3  obs
    4  bus              (inside it: tests/unit/bus/test_layers.py)
    5  lifecycle        (the service shell: signals, drain, supervised tasks)

Above the core: the services (`rlbus_inference`, `rlbus_orchestrator`, `rlbus_trainer`) and the
launch package (`rlbus_launch`). The core imports neither; no service imports the launch package
or another service. No module anywhere in the three layers is part of an import cycle.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "shared/src/rlbus"
PACKAGES = {
    "rlbus": CORE,
    "rlbus_launch": ROOT / "launch/src/rlbus_launch",
    "rlbus_inference": ROOT / "services/inference/src/rlbus_inference",
    "rlbus_orchestrator": ROOT / "services/orchestrator/src/rlbus_orchestrator",
    "rlbus_trainer": ROOT / "services/trainer/src/rlbus_trainer",
}
SERVICES = ("rlbus_inference", "rlbus_orchestrator", "rlbus_trainer")

CORE_LAYERS = {
    "__init__": 0,
    "wire": 0,
    "netutil": 0,
    "docstrings": 0,
    "secrets": 0,
    "process_marks": 0,
    "broadcast": 0,
    "envindex": 0,
    "placement": 0,
    "checksums": 1,
    "rundirs": 1,
    "samples": 1,
    "configs": 2,
    "obs": 3,
    "bus": 4,
    "lifecycle": 5,
}


def module_name(package: str, path: Path) -> str:
    parts = [package, *path.relative_to(PACKAGES[package]).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {
        module_name(package, path): path
        for package, root in PACKAGES.items()
        for path in sorted(root.rglob("*.py"))
    }


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in the file (deferred imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        found.update(name for name in names if name in known)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, set(modules)) - {name} for name, path in modules.items()}


def core_unit(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def test_every_core_unit_has_a_layer():
    units = {p.stem for p in CORE.glob("*.py")} | {p.name for p in CORE.iterdir() if p.is_dir()}
    assert units - {"__pycache__"} == set(CORE_LAYERS), "give each new core module a layer"


def test_core_imports_run_downward():
    upward = [
        f"{source} imports {target}"
        for source, targets in import_graph().items()
        if source.split(".")[0] == "rlbus"
        for target in targets
        if target.split(".")[0] == "rlbus"
        and core_unit(target) != core_unit(source)
        and CORE_LAYERS[core_unit(target)] >= CORE_LAYERS[core_unit(source)]
    ]
    assert upward == []


def test_core_imports_no_service_and_no_launcher():
    above = [
        f"{source} imports {target}"
        for source, targets in import_graph().items()
        if source.split(".")[0] == "rlbus"
        for target in targets
        if target.split(".")[0] != "rlbus"
    ]
    assert above == []


def test_services_import_only_the_core_and_themselves():
    crossing = [
        f"{source} imports {target}"
        for source, targets in import_graph().items()
        if source.split(".")[0] in SERVICES
        for target in targets
        if target.split(".")[0] not in ("rlbus", source.split(".")[0])
    ]
    assert crossing == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_graph() -> dict[str, set[str]]:
    """The import graph with each package's `__init__` re-exports left out: `from rlbus.bus import
    Bus` reaches `rlbus.bus.client`, not a cycle through the package."""
    graph = import_graph()
    return {
        source: {t for t in targets if t not in PACKAGES and not is_package(t)}
        for source, targets in graph.items()
    }


def is_package(module: str) -> bool:
    path = all_modules().get(module)
    return path is not None and path.name == "__init__.py"


def test_no_import_cycles():
    assert cycles(package_graph()) == []


def test_the_cycle_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
