"""Import boundaries of the bus, read from the source with `ast` (TYPE_CHECKING blocks included).

- Inside `rlbus.bus`, imports run one way: errors/stats/kvwatch/topology <- claimcheck <-
  quarantine <- core/connection <- consumer/kv/steplog/control <- records <- client (no module
  takes helpers back from a module above it).
- nats-py is imported only inside `shared/src/rlbus/bus/` and by `benchmarks/bus.py`, whose job is
  to compare bare nats-py with the facade (docs/bus.md, "Benchmark").
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BUS_DIR = ROOT / "shared/src/rlbus/bus"
SCANNED_DIRS = ("shared", "launch", "services", "tests", "benchmarks")
NATS_ALLOWED = (BUS_DIR, ROOT / "benchmarks/bus.py")

# Lower rank = lower layer; a module may import only modules of a strictly lower rank.
BUS_LAYERS = {
    "errors": 0,
    "natsauth": 0,  # users, permissions and TLS files: imports no other bus module
    "stats": 0,  # the stream-statistics snapshot
    "kvwatch": 0,  # raw KV updates through outages (KV decodes them)
    "topology": 0,  # server-side configs of streams, durables and buckets
    "claimcheck": 1,
    "quarantine": 2,  # dead-letter headers and records
    "core": 3,
    "connection": 3,
    "consumer": 4,
    "kv": 4,
    "steplog": 4,
    "control": 4,  # control request/reply
    "records": 5,  # the replica registry and the run's end, read through KV
    "client": 6,
}


def imported_modules(path: Path) -> set[str]:
    """Dotted names of every module `path` imports, anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from rlbus.bus import claimcheck` imports the submodule rlbus.bus.claimcheck
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def bus_imports(path: Path) -> set[str]:
    """Sibling modules of `rlbus.bus` that `path` imports (short names, e.g. `core`)."""
    prefix = "rlbus.bus."
    return {
        name[len(prefix) :].split(".")[0]
        for name in imported_modules(path)
        if name.startswith(prefix) and name[len(prefix) :].split(".")[0] in BUS_LAYERS
    }


def test_every_bus_module_has_a_layer():
    modules = {p.stem for p in BUS_DIR.glob("*.py")} - {"__init__"}
    assert modules == set(BUS_LAYERS), "give each new rlbus.bus module a rank in BUS_LAYERS"


def test_bus_imports_run_one_way():
    upward = [
        f"{module}.py imports {target}.py"
        for module, rank in BUS_LAYERS.items()
        for target in bus_imports(BUS_DIR / f"{module}.py")
        if BUS_LAYERS[target] >= rank
    ]
    assert upward == []


def test_core_imports_none_of_the_modules_built_on_it():
    assert bus_imports(BUS_DIR / "core.py").isdisjoint({"client", "consumer", "kv", "steplog"})


def raw_nats_importers() -> list[str]:
    offenders = []
    for top in SCANNED_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if any(path == allowed or allowed in path.parents for allowed in NATS_ALLOWED):
                continue
            if any(name == "nats" or name.startswith("nats.") for name in imported_modules(path)):
                offenders.append(str(path.relative_to(ROOT)))
    return offenders


def test_only_the_bus_imports_nats_py():
    assert raw_nats_importers() == [], "use rlbus.bus (Bus, KV, StepLog, errors) instead of nats-py"


def test_the_scan_sees_a_raw_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from nats.js.errors import NotFoundError\n")
    assert "nats.js.errors" in imported_modules(sample)
