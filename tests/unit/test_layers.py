"""The house's walls: every flodl_zmq import runs down the layers, none loops, the cores stay pure, no file grows fat.

The layers are the picture in docs/architecture.md; a module not listed here
fails the test, so a new module gets a place in the picture before it lands.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "flodl_zmq"

# Bottom to top. A module may import its own layer or any below it, never above.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("errors", "tensors", "int8", "wire_format", "threads", "mailbox", "service_loop", "shards",
             "settings"),
    "wire": ("wire", "wire.fields", "wire.records", "wire.mac", "wire.codec", "wire.shm", "wire.stream", "endpoints"),
    "cores": (
        "fold", "sums", "outer", "reducer", "robust", "sampling",
        "coordinator", "coordinator.config", "coordinator.core", "coordinator.dispatch",
        "coordinator.chunk_pool", "coordinator.elche", "coordinator.convergence",
        "coordinator.timing", "coordinator.liveness", "coordinator.roles",
        "coordinator.metrics", "coordinator.sim", "coordinator.strategy", "coordinator.feedback",
        "coordinator.resume", "coordinator.outputs", "coordinator.rounds", "formation", "join", "host_links", "relay_core",
        "step_report",
    ),
    "run": (
        "job", "payload", "links", "private_files", "trust", "datasets", "bundle", "environment", "security",
        "io_threads", "result", "tfevents", "runlog", "report", "runreport", "loader", "training", "checkpoints",
        "relay_config", "reducer_config", "reducer_messages", "param_buffers", "agent_rules", "alone",
    ),
    "services": (
        "relay", "relay_data", "reducer_service", "membership", "membership_link", "status_server", "metrics", "control_router",
        "controller_shards", "controller_service", "rank_link", "rank",
    ),
    "roles": ("session", "accelerate", "api", "controller", "agent", "agent_cli", "launch", "remote", "demo", "cli", "warm",
              "__init__"),
}
RANK = {module: i for i, layer in enumerate(LAYERS.values()) for module in layer}

# What a sans-I/O core must not touch: sockets, threads, clocks, processes.
IMPURE = ("zmq", "socket", "select", "threading", "concurrent", "asyncio", "time", "subprocess", "multiprocessing")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of the file (lazy imports count)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            # `from flodl_zmq import bundle` imports the submodule bundle.
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def graph() -> dict[str, set[str]]:
    """flodl_zmq module -> the flodl_zmq modules it imports."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {i.removeprefix("flodl_zmq.") for i in imports(path) if i.startswith("flodl_zmq.")}
        # A module's own package is initialised before it anyway: no edge to it.
        edges[name] = {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return edges


def test_every_module_has_a_layer():
    unplaced = sorted(set(graph()) - set(RANK))
    assert not unplaced, f"give {unplaced} a layer in LAYERS and in docs/architecture.md's picture"


def test_imports_never_run_up_a_layer():
    upward = sorted(
        (src, dst) for src, dsts in graph().items() for dst in dsts if RANK.get(dst, -1) > RANK.get(src, 99)
    )
    assert not upward, f"imports from a lower layer to a higher one: {upward}"


def test_no_import_loop():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    loops: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                loops.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not loops, f"import loops: {loops}"


# Every module of the cores layer, not only the scheduler.
PURE = sorted(PACKAGE / (name.replace(".", "/") + ("/__init__.py" if name == "coordinator" else ".py"))
              for name in LAYERS["cores"])


@pytest.mark.parametrize("path", PURE, ids=lambda p: p.name)
def test_a_core_touches_no_socket_thread_or_clock(path):
    bad = sorted(i for i in imports(path) if i.split(".")[0] in IMPURE)
    assert not bad, f"{path.name} imports {bad}: it is a pure core (time comes in as an argument)"


# A module or a function past these sizes mixes rules with plumbing again (issue 28's shells).
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 60


def test_no_module_or_function_outgrows_its_limit():
    fat = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(PACKAGE)
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            fat.append(f"{where}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    fat.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    assert not fat, (f"over {MAX_MODULE_LINES} lines a module, {MAX_FUNCTION_LINES} a function (move a rule "
                     f"into a core, or a step into a named method): {fat}")
