"""docs/architecture.md holds for the tree as it is: the files it names exist, the names it places in a
file are defined there, its layer list is tools/import_scan.py's, and its two walkthroughs are true
(an optimizer is written in one file; a step strategy is its own module plus its line in table.py)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

from memfit.strategies import optimizers
from memfit.strategies.optimizers import OPTIMIZER_ENTRIES, OPTIMIZERS, OptimizerEntry
from memfit.strategies.step_strategy import StepStrategy
from memfit.strategies.table import STEP_STRATEGIES

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()
OPTIMIZERS_FILE = "memfit/strategies/optimizers.py"
TABLE_FILE = "memfit/strategies/table.py"
# Optimizer names written outside their entry as a value a user could write, never as a rule about
# that optimizer: the config's default, the DeepSpeed check that optim.name was left at that default,
# and a variant the benchmark runs.
NAMED_AS_A_VALUE = {("adamw", "memfit/config/schema.py"), ("adamw", "memfit/config/deepspeed.py"),
                    ("adamw-8bit", "memfit/benchmark.py")}


def _python_files() -> dict[str, ast.Module]:
    return {str(path.relative_to(ROOT)): ast.parse(path.read_text(), filename=str(path))
            for path in sorted((ROOT / "memfit").rglob("*.py"))}


def _defines(path: Path, name: str) -> bool:
    return re.search(rf"^\s*(def|class)\s+{name}\b|^\s*{name}\s*[:=]", path.read_text(), re.MULTILINE) is not None


def _placed_in(place: str, name: str) -> bool:
    """`name` is defined in the file `place`, or is an attribute of the package `place` (memfit/config)."""
    if (ROOT / place).is_dir():
        return hasattr(importlib.import_module(place.replace("/", ".")), name)
    return _defines(ROOT / place, name)


def test_every_file_the_doc_names_exists():
    named = set(re.findall(r"[\w./-]+\.(?:py|md)\b", DOC)) - {"architecture.md"}
    assert named, "the doc names no files: the pattern no longer matches it"
    missing = []
    for name in sorted(named):
        if "NAME" in name:  # the walkthrough's placeholder for a new module
            continue
        if "/" in name:
            found = (ROOT / name).is_file()
        else:  # a bare file name: somewhere in the project's own folders
            found = any(any((ROOT / folder).rglob(name)) for folder in ("memfit", "tests", "bench", "docs", "tools"))
        if not found:
            missing.append(name)
    assert missing == []


def test_every_name_the_doc_places_in_a_file_is_defined_there():
    placed = re.findall(r"(memfit/[\w/]+)(?:\.py)?: (\w+)", DOC)  # memfit/build.py: build_run
    code = r"`(\w+)(?:\([^`]*\))?`"  # `build_run` or `build_run(cfg, ...)`
    placed += [(path, name) for name, path in re.findall(code + r"\s+in\s+(memfit/[\w/]+)", DOC)]
    placed += [(path, name) for name, path in re.findall(code + r"\s+\((memfit/[\w/]+)", DOC)]
    placed = [(path if (ROOT / path).is_dir() else path + ".py", name) for path, name in placed if "NAME" not in path]
    assert len(placed) >= 10, "the doc places few names: the patterns no longer match it"
    undefined = [f"{path}: {name}" for path, name in placed if not _placed_in(path, name)]
    assert undefined == []


def test_the_layer_list_is_the_import_scans():
    spec = importlib.util.spec_from_file_location("import_scan", ROOT / "tools" / "import_scan.py")
    scan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scan)
    block = DOC.split("## Layers", 1)[1].split("```")[1]
    listed = []
    for line in block.strip().splitlines():
        names = re.split(r"\s{2,}", line.strip())[0]
        listed.append(tuple(f"memfit.{name.strip().rstrip('/')}" for name in names.split(",")))
    assert listed == list(reversed(scan.LAYERS))


def test_an_optimizer_is_written_in_its_entry_file_only():
    written = {(node.value, path) for path, tree in _python_files().items() for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and node.value in OPTIMIZERS}
    assert {name for name, path in written if path == OPTIMIZERS_FILE} == set(OPTIMIZERS)
    assert {(name, path) for name, path in written if path != OPTIMIZERS_FILE} <= NAMED_AS_A_VALUE


def test_every_optimizer_entry_is_in_the_table():
    built_in = {path for path, tree in _python_files().items() for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "OptimizerEntry"}
    assert built_in == {OPTIMIZERS_FILE}
    entries = [value for value in vars(optimizers).values() if isinstance(value, OptimizerEntry)]
    assert len(entries) == len(OPTIMIZER_ENTRIES) and set(map(id, entries)) == set(map(id, OPTIMIZER_ENTRIES))


def test_every_step_strategy_is_its_own_module_and_listed_in_the_table():
    files = _python_files()
    built = {path: sum(isinstance(node, ast.Call) and getattr(node.func, "id", None) == "StepStrategy"
                       for node in ast.walk(tree)) for path, tree in files.items()}
    modules = {path for path, count in built.items() if count}
    assert all(built[path] == 1 and path.startswith("memfit/strategies/") for path in modules)
    imported = {node.module for node in ast.walk(files[TABLE_FILE])
                if isinstance(node, ast.ImportFrom) and node.module.startswith("memfit.strategies.")}
    module_names = {path[:-3].replace("/", ".") for path in modules}
    assert module_names == imported
    found = {id(value) for name in module_names for value in vars(importlib.import_module(name)).values()
             if isinstance(value, StepStrategy)}
    assert found == set(map(id, STEP_STRATEGIES))


def test_the_doc_tells_no_history():
    told = [phrase for phrase in ("used to", "no longer", "previously", "moved from", "before this")
            if phrase in DOC.lower()]
    assert told == []


def test_a_model_family_is_one_module_registered_in_the_table_and_never_named_in_a_comparison():
    from memfit.memory import families

    folder = ROOT / "memfit" / "memory" / "families"
    modules = {path.stem for path in folder.glob("*.py") if path.name != "__init__.py"}
    assert modules == {module.__name__.rsplit(".", 1)[-1] for module in families.FAMILIES.values()}
    names = set(families.FAMILIES)
    compared = [f"{path}:{node.lineno}" for path, tree in _python_files().items() if path.startswith("memfit/memory/")
                for node in ast.walk(tree) if isinstance(node, ast.Compare)
                and any(isinstance(side, ast.Constant) and side.value in names for side in [node.left, *node.comparators])]
    assert compared == []
    assert "family ==" not in "".join((ROOT / path).read_text() for path in _python_files() if path.startswith("memfit/memory/"))
