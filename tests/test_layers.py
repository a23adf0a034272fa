"""The package's shape, read from its source with `ast` (nothing is imported).

Every `import` in `src/wansync` counts, function-local ones included: an import inside a function
still ties the two modules together, only later. An edge goes to the module an import names
(`from wansync.net import records` names `wansync.net.records`); the parent packages Python
initializes on the way are not edges, since a package's `__init__` only re-exports its modules.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "wansync"

# Module-level containers meant to be mutable: the codec registry of comm/ (a plain dict there; it can
# become a MappingProxyType like the tables here). The strategy registry is read-only: a catalog of
# names and options, and the classes found from it (`wansync.strategies`).
MUTABLE_ALLOWED = {
    "wansync.comm.codecs.CODECS",
}
MUTABLE_CALLS = {
    "dict",
    "list",
    "set",
    "bytearray",
    "defaultdict",
    "OrderedDict",
    "deque",
    "Counter",
    "Lock",
    "RLock",
    "Event",
    "Condition",
    "Semaphore",
    "Queue",
    "SimpleQueue",
    "local",
}


def module_files() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


class Trees(dict):
    """Each module's syntax tree, parsed when a test first asks for it (not while pytest collects)."""

    def __missing__(self, name: str) -> ast.Module:
        tree = self[name] = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
        return tree


MODULES = module_files()
TREES = Trees()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def imports_of(name: str) -> set[str]:
    """The package modules `name` imports, anywhere in its source."""
    found: set[str] = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                here = name.split(".") if _is_package(name) else name.split(".")[:-1]
                base = ".".join(here[: len(here) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # `import wansync.net.link as x` names a module; trim attributes
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    return {name: imports_of(name) for name in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _in(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def edges(src: tuple[str, ...], dst: tuple[str, ...]) -> list[str]:
    """Imports from modules under `src` of modules under `dst`."""
    return sorted(f"{a} -> {b}" for a, bs in graph().items() if _in(a, *src) for b in bs if _in(b, *dst))


def test_the_graph_sees_the_package():
    assert "wansync.net.backend" in MODULES and "wansync.strategies.base" in MODULES
    assert "wansync.comm.exchange" in graph()["wansync.strategies.base"]


def test_no_module_imports_its_way_back_to_itself():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_strategy_never_imports_a_workload():
    assert edges(("wansync.strategies",), ("wansync.workloads",)) == []


def test_a_workload_never_imports_a_strategy_or_the_exchange():
    assert edges(("wansync.workloads",), ("wansync.strategies", "wansync.comm", "wansync.net")) == []


def test_strategies_and_the_exchange_take_a_quorum_without_importing_fault_tolerance():
    assert edges(("wansync.strategies", "wansync.comm"), ("wansync.ft",)) == []


def test_net_knows_nothing_about_training():
    outside = [
        e for e in edges(("wansync.net",), (PACKAGE,)) if not _in(e.split(" -> ")[1], "wansync.net", "wansync.errors")
    ]
    assert outside == []


# The map of docs/architecture.md: every module of the package, top to bottom in the order a run
# passes through them (the CLI, then the grid, one run, its processes, one rank's loop, the strategy,
# the exchange, the link). A module may import only from layers below its own. An entry ending in
# ".*" is a package with everything in it; any other entry is one module.
STACK = (
    ("wansync.__main__",),
    ("wansync.cli",),
    ("wansync.integrations.*",),  # adapters to other loops (HF Trainer): the public API's users
    ("wansync",),  # the public API: init, strategy
    (
        "wansync.planner",
        "wansync.planner.tables",
        "wansync.planner.scale_table",
        "wansync.planner.measure",  # `wansync plan`: what it prints,
        "wansync.planner.published",
    ),  # measures and reproduces
    ("wansync.results.*",),
    ("wansync.runner.demo",),
    ("wansync.runner.experiments",),
    ("wansync.runner.grid",),  # the grid as the user writes it
    ("wansync.analysis.*",),
    ("wansync.presets",),
    ("wansync.runner",),
    ("wansync.runner.run",),
    ("wansync.runner.agreement",),  # torchrun's ranks agree on what they train
    ("wansync.runner.launch",),
    ("wansync.ft.supervisor", "wansync.ft.lighthouse"),  # the launcher's side of a fault-tolerant run
    ("wansync.runner.workerproc",),
    ("wansync.runner.worker",),
    ("wansync.runner.interrupts",),
    ("wansync.trainer.*",),
    ("wansync.planner.*",),  # its predictions: the CLI's, and --adapt's (trainer.adapt)
    ("wansync.ft.own_loop",),  # fault tolerance in a user's own loop (ws.FaultTolerance)
    ("wansync.ft.member",),  # the worker's side of a fault-tolerant run
    ("wansync.config",),
    ("wansync.strategies.*", "wansync.workloads.*"),  # side by side: neither imports the other
    (
        "wansync.ft",
        "wansync.ft.quorum",
        "wansync.ft.listeners",
        "wansync.ft.transport",
        "wansync.ft.quorums",
        "wansync.ft.support",
        "wansync.ft.nodes",
    ),
    ("wansync.telemetry.run",),  # one loop's run (ws.Run): times a strategy and its exchange
    ("wansync.comm.*",),
    ("wansync.telemetry.*",),
    ("wansync.rundir.*",),
    ("wansync.net.*",),
    (
        "wansync.runner.torchrun",
        "wansync.runner.localgroup",  # process groups on this machine or torchrun's,
        "wansync.runner.rendezvous",
        "wansync.runner.route",
    ),  # and the routes between hosts
    ("wansync.trust.*",),  # the run secret, admission, sealed payloads, where listeners bind
    ("wansync.rules", "wansync.units"),
    ("wansync.errors",),
)


def _matches(module: str, entry: str) -> bool:
    if entry.endswith(".*"):
        return module == entry[:-2] or module.startswith(entry[:-1])
    return module == entry


def layer_of(module: str) -> int | None:
    """The index of the layer that places `module` (an exact entry wins over a package's), or None."""
    exact = [i for i, layer in enumerate(STACK) if module in layer]
    if exact:
        return exact[0]
    return next((i for i, layer in enumerate(STACK) if any(_matches(module, e) for e in layer)), None)


def test_every_module_has_its_place_on_the_map():
    assert [m for m in MODULES if layer_of(m) is None] == []


def test_a_module_off_the_map_is_found():
    assert layer_of("wansync.scratch") is None and layer_of("wansync.runner.scratch") is None
    assert layer_of("wansync.strategies.scratch") == layer_of("wansync.strategies")


def test_imports_point_down_the_stack():
    up = sorted(
        f"{a} -> {b}"
        for a, bs in graph().items()
        for b in bs
        if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) < layer_of(a)
    )
    assert up == []


def test_the_library_never_imports_the_application():
    library = (
        "wansync.strategies",
        "wansync.comm",
        "wansync.net",
        "wansync.telemetry",
        "wansync.workloads",
        "wansync.config",
        "wansync.rundir",
        "wansync.errors",
    )
    application = (
        "wansync.cli",
        "wansync.runner",
        "wansync.trainer",
        "wansync.analysis",
        "wansync.results",
        "wansync.presets",
        "wansync.planner",
    )
    assert edges(library, application) == []


def test_only_the_cli_and_the_controller_import_the_planner():
    """The planner's predictions serve `wansync plan` and `--adapt` (no second model of the run's time)."""
    assert [
        e
        for e in edges((PACKAGE,), ("wansync.planner",))
        if not _in(e.split(" -> ")[0], "wansync.planner")
        and not e.startswith("wansync.cli ")
        and not e.startswith("wansync.trainer.adapt ")
    ] == []


def test_the_planner_never_imports_the_application():
    application = ("wansync.runner", "wansync.analysis", "wansync.results", "wansync.presets")
    assert edges(("wansync.planner",), application) == []


def test_only_the_entry_point_imports_the_cli():
    assert [e for e in edges((PACKAGE,), ("wansync.cli",)) if not e.startswith("wansync.__main__ ")] == []


# ---------------------------------------------------------------- module-level state


def _frozen_dataclasses(tree: ast.Module) -> set[str]:
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and any(
                    k.arg == "frozen" and getattr(k.value, "value", False) for k in d.keywords
                ):
                    out.add(node.name)
    return out


def _mutable(value: ast.AST | None, classes: set[str], frozen: set[str]) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        return fname in MUTABLE_CALLS or (fname in classes and fname not in frozen)
    return False


def module_state(name: str) -> list[str]:
    """Module-level names bound to a mutable container or object, and `global` rebinding anywhere."""
    tree = TREES[name]
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    frozen = _frozen_dataclasses(tree)
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        elif isinstance(node, ast.AugAssign):
            targets, value = [node.target], ast.List()  # `X += ...` at module level mutates X
        else:
            continue
        for t in targets:
            if isinstance(t, ast.Name) and t.id != "__all__" and _mutable(value, classes, frozen):
                found.append(f"{name}.{t.id}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found += [f"{name}.{n} (global statement)" for n in node.names]
        elif (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and node in tree.body
            and isinstance(node.value.func.value, ast.Name)
            and node.value.func.attr in ("update", "append", "extend", "add", "setdefault", "insert")
        ):
            found.append(f"{name}.{node.value.func.value.id} (mutated at import)")
    return found


def test_no_module_level_mutable_state_outside_the_codec_registry():
    state = [s for name in MODULES for s in module_state(name) if s.split(" ")[0] not in MUTABLE_ALLOWED]
    assert state == []


def test_the_state_check_sees_containers_globals_and_instances():
    TREES["<probe>"] = ast.parse(
        "import threading\nA = {}\nB: list = []\nC = (1,)\nD = threading.Lock()\n"
        "class K: pass\nE = K()\nF = frozenset()\nA.update(x=1)\n"
        "def f():\n    global C\n"
    )
    try:
        assert sorted(module_state("<probe>")) == [
            "<probe>.A",
            "<probe>.A (mutated at import)",
            "<probe>.B",
            "<probe>.C (global statement)",
            "<probe>.D",
            "<probe>.E",
        ]
    finally:
        del TREES["<probe>"]
