"""The package's layers (docs/explanations/architecture.md): a module imports only from the layers below it,
and within its own layer only from its own package. The import graph counts every import, a function's own imports and
those under `if TYPE_CHECKING:` included, so a deferred import cannot hide an upward edge or a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "paratrain"

# Bottom to top. The number is the layer of docs/explanations/architecture.md; where one layer's modules build on
# each other, it is cut in ordered parts. A name stands for its module, or its package and every module in it (a module
# named on its own, as data.sharding is, belongs where it is named). The modules of one entry are siblings: none
# imports another, except inside its own package.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("0 base", ("errors", "import_path", "clock", "tcp_timeout", "oom", "_in_forkserver", "data.sharding")),
    ("0 base: who started this process", ("env",)),
    ("0 base: on errors and env", ("interrupt", "userframes", "proc", "prefork", "extras")),
    ("1 records", ("rundir", "devices", "dist")),
    ("1 records: sharded checkpoints' folders", ("sharded",)),
    ("1 records: the configuration and the checkpoint files", ("config", "checkpoint")),
    ("1 records: on the configuration", ("runlength", "recipes", "requeue")),
    ("2 components", ("data", "models", "batchnorm", "phases")),
    ("2 components: on the data and the models", ("userparts", "optim", "losses", "evaluation", "metrics", "runlog",
                                                  "predict")),
    ("3 assembly: a run's pieces from its configuration", ("build",)),
    ("3 assembly", ("inputs", "usercheck", "strategies")),
    ("4 plan", ("runplan",)),
    ("5 worker: a run's state as it goes, and its summary", ("runstate",)),
    ("5 worker: the checkpoint a worker carries on from, the training loop", ("resume", "train")),
    ("5 worker", ("worker",)),
    ("6 processes", ("launch",)),
    ("6 processes: what --devices auto measures on them", ("autodevices",)),
    ("7 entries: the session that opens a run", ("session",)),
    ("7 entries: a run's trained network loaded back", ("trained",)),
    ("7 entries", ("api", "search", "doctor", "bench", "forecast", "plot")),
    ("7 entries: the command line", ("cli",)),
    ("7 entries: the package", ("", "__main__")),
]
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports (relative and absolute, anywhere in the file)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            wanted = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - node.level + 1]
                head = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("paratrain"):
                head = node.module.removeprefix("paratrain").lstrip(".")
            else:
                continue
            # `from . import config`: the package's root (a lazy __init__) is not what it imports
            wanted = ([head] if head else []) + [f"{head}.{a.name}" if head else a.name for a in node.names]
        else:
            continue
        for target in wanted:
            target = target.removeprefix("paratrain.") if target.startswith("paratrain.") else target
            while target not in modules and "." in target:  # `from . import x` names a module or a name in one
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                targets.add(target)
    return targets


def _entry(name: str) -> tuple[int, str]:
    """(layer index, the entry that places it): the most specific entry naming the module or its package."""
    best: tuple[int, str] | None = None
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if name == entry or (entry and name.startswith(entry + ".")):
                if best is None or len(entry) > len(best[1]):
                    best = (index, entry)
    assert best is not None, f"paratrain.{name} is in no layer: add it to LAYERS in {__file__}"
    return best


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer_and_imports_only_below_it() -> None:
    wrong = []
    for name, targets in _graph().items():
        mine, my_entry = _entry(name)
        for target in targets:
            theirs, their_entry = _entry(target)
            if theirs > mine or (theirs == mine and their_entry != my_entry):
                wrong.append(f"paratrain.{name} ({LAYERS[mine][0]}) imports paratrain.{target} ({LAYERS[theirs][0]})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle() -> None:
    graph, seen, cycles = _graph(), set(), []

    def visit(node: str, stack: list[str]) -> None:
        seen.add(node)
        stack.append(node)
        for target in sorted(graph[node]):
            if target in stack:
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in seen:
                visit(target, stack)
        stack.pop()

    for node in sorted(graph):
        if node not in seen:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_module_is_over_the_ceiling() -> None:
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_check_sees_an_upward_import_in_a_function(tmp_path: Path) -> None:
    """The graph reads a function's own imports: the test above could not pass over one."""
    path = tmp_path / "mod.py"
    path.write_text("import os\n\n\ndef f():\n    from .launch import run\n")
    assert _imports("rundir", path, {"rundir": path, "launch": path, "worker": path}) == {"launch"}
    assert _entry("rundir")[0] < _entry("launch")[0]
