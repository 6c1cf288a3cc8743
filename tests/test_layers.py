"""The package's layers (docs/explanations/architecture.md): a module imports only from the layers below it,
and within its own layer only from its own package. The import graph counts every import, a function's own imports and
those under `if TYPE_CHECKING:` included, so a deferred import cannot hide an upward edge or a cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "paratrain"

# Bottom to top, by folder: the layers of docs/explanations/architecture.md. A name stands for a package and every
# module in it, or for one of the few modules at the top. The folders of one entry are siblings: none imports the
# other; inside a folder its modules import each other freely (the cycle test still holds them).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("0 core: errors, optional dependencies, the user's line, safe files", ("core",)),
    ("1 runtime: this process, who started it, its devices and group", ("runtime",)),
    ("2 config: the configuration, the run's length, the recipes", ("config",)),
    ("3 data and models", ("data", "models")),
    ("4 checkpoints, a model's features, optimisation", ("checkpoint", "features", "optimization")),
    ("5 what a training run is assembled from; its records and trackers", ("components", "tracking")),
    ("6 parallel: layouts, strategies, the plan, the launcher", ("parallel",)),
    ("7 training: one worker's life, the Trainer", ("training",)),
    ("8 a trained run loaded back; measurements", ("inference", "measure")),
    ("9 the session that opens a run", ("session",)),
    ("10 entries: the Python API, search", ("api", "search")),
    ("11 the command line", ("cli",)),
    ("12 the package", ("", "__main__")),
]
MAX_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_TOP_MODULES = 6  # __init__, __main__, api, session: the rest lives in the folders above


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
    path.write_text("import os\n\n\ndef f():\n    from ..parallel.launch import run\n")
    modules = {"checkpoint.run_folder": path, "parallel.launch": path, "training.worker": path}
    assert _imports("checkpoint.run_folder", path, modules) == {"parallel.launch"}
    assert _entry("checkpoint.run_folder")[0] < _entry("parallel.launch")[0]


def test_the_top_of_the_package_holds_folders_and_a_few_modules() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules at the top of src/paratrain: {top}; give them a folder"
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    named = {entry.partition(".")[0] for _, entries in LAYERS for entry in entries}
    assert folders <= named, f"folders in no layer: {sorted(folders - named)}"


def _long_functions(path: Path, limit: int, root: Path = PACKAGE) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{path.relative_to(root)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_is_over_the_ceiling() -> None:
    long = [f for path in sorted(PACKAGE.rglob("*.py")) for f in _long_functions(path, MAX_FUNCTION_LINES)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (cut them into named steps):\n" + "\n".join(long)


def test_the_function_check_counts_a_method_and_a_nested_function(tmp_path: Path) -> None:
    path = tmp_path / "mod.py"
    body = "        x = 1\n" * 60
    path.write_text(f"class C:\n    def long(self):\n{body}\n\ndef outer():\n    def inner():\n{body}\n"
                    "\ndef short():\n    return 1\n")
    found = [line.split()[1] for line in _long_functions(path, 60, tmp_path)]
    assert sorted(found) == ["inner", "long", "outer"]


RUN_FOLDER_NAMES = re.compile(r'"(summary\.json|config\.yaml|parts\.yaml|metrics\.jsonl|metrics\.csv|trackers\.json'
                              r'|checkpoints|tb|data-cache)"')
PATH_JOIN = re.compile(r"/\s*" + RUN_FOLDER_NAMES.pattern + r"|\(\s*" + RUN_FOLDER_NAMES.pattern + r"\s*,")


def _spelled_run_paths(source: str) -> list[str]:
    """The lines of `source` that join a run folder's file or folder name to a path, or list one as a name."""
    return [line.strip() for line in source.splitlines() if PATH_JOIN.search(line)]


def test_the_run_folders_paths_are_named_in_one_module() -> None:
    """core/run_paths.py names every path of a run folder; no other module spells one (a message may name them)."""
    spelled = {path.relative_to(PACKAGE).as_posix(): found for path in PACKAGE.rglob("*.py")
               if path.name != "run_paths.py" and (found := _spelled_run_paths(path.read_text()))}
    assert not spelled, spelled


def test_the_run_paths_check_sees_a_joined_name_and_a_listed_one() -> None:
    assert _spelled_run_paths('x = run / "summary.json"\ny = ("checkpoints", True)\nprint("see summary.json")') == [
        'x = run / "summary.json"', 'y = ("checkpoints", True)']


# A layout's name compared outside parallel/, left where it is for now: each is a measurement's own reading of a
# bench row (its --configs token's words), not a rule of the layout. New ones fail the test below.
LAYOUT_NAMES_LEFT = {
    "cli/plan.py": "fsdp rows of a bench's results.json get the sharded traffic model (rows before 'strategy')",
    "measure/scaling.py": "the same: an fsdp row's predicted rate adds the sharding's traffic",
    "measure/bench.py": "the --configs grammar: pipeline-cpu:KxM's second number is micro-batches, hybrid's copies",
}
LAYOUT_NAMES = {"ddp", "tower", "pipeline", "hybrid", "fsdp", "hsdp", "tp", "single"}


def _literals(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_literals(e) for e in node.elts))
    return set()


def _compared_layout_names(source: str) -> list[int]:
    """The lines of `source` that compare something with a layout's name (==, !=, in, startswith)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            named = set().union(*(_literals(n) for n in (node.left, *node.comparators)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("startswith", "endswith"):
            named = set().union(*(_literals(a) for a in node.args))
        else:
            continue
        if named & LAYOUT_NAMES:
            lines.append(node.lineno)
    return lines


def test_no_code_outside_parallel_compares_a_layouts_name() -> None:
    """What a layout allows or needs is declared on it (parallel/strategies/base.py's capabilities); the code
    outside parallel/ asks those, never the name."""
    found = {rel: lines for path in PACKAGE.rglob("*.py")
             if not (rel := path.relative_to(PACKAGE).as_posix()).startswith("parallel/")
             and rel not in LAYOUT_NAMES_LEFT and (lines := _compared_layout_names(path.read_text()))}
    assert not found, found
    assert all(_compared_layout_names((PACKAGE / rel).read_text()) for rel in LAYOUT_NAMES_LEFT), \
        "a file left with a layout's name compares none now: take it off LAYOUT_NAMES_LEFT"


def test_the_layout_name_check_sees_a_comparison_a_membership_and_a_prefix() -> None:
    source = 'a = cfg.strategy == "ddp"\nb = s in ("fsdp", "hsdp")\nc = k.startswith("tp")\nd = x == "auto"\n'
    assert _compared_layout_names(source) == [1, 2, 3]
