"""Import scan: cycles between memfit modules, upward imports between layers, local imports.

    python tools/import_scan.py          # prints the findings; exit 1 if any

Layers, lowest first. A module may import its own layer or any lower one, never a higher one. An import
under `if TYPE_CHECKING:` runs nothing, so it makes no cycle; it is still an upward import: a module that
names a higher layer's types depends on what that layer holds (memfit.strategies reads no config).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "memfit"

# The first matching prefix gives a module's layer.
LAYERS: list[tuple[str, ...]] = [
    ("memfit.errors", "memfit.units", "memfit.tensors"),
    ("memfit.strategies",),          # torch building blocks; know nothing of configs
    ("memfit.config",),              # fields, choices and every cross-field rule
    ("memfit.models",),
    ("memfit.data",),
    ("memfit.step", "memfit.build", "memfit.checkpoint"),  # one run's pieces, shared by trainer and tracer
    ("memfit.distributed",),         # engines that wrap, save and resume a built run
    ("memfit.memory",),              # estimate, trace (builds a run on meta), search, report
    ("memfit.train",),               # the loop
    ("memfit.cli", "memfit.benchmark", "memfit.demo", "memfit.generate", "memfit.__main__"),
]


def layer_of(module: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return -1  # memfit/__init__ and anything unlisted: not checked


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> list[tuple[str, int, bool, bool]]:
    """(imported memfit module, line, is_local, for type checking only) for every memfit import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in child.names]
            else:
                visit(child, inside)
                continue
            if isinstance(child, ast.ImportFrom) or isinstance(child, ast.Import):
                guarded = _type_checking(child, tree)
                for name in names:
                    if name.startswith("memfit"):
                        while name not in modules and "." in name:
                            name = name.rpartition(".")[0]
                        found.append((name, child.lineno, local, guarded))

    visit(tree, False)
    return found


def _type_checking(node: ast.AST, tree: ast.Module) -> bool:
    for top in tree.body:
        if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test):
            if any(n is node for n in ast.walk(top)):
                return True
    return False


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]; counter[0] += 1
        stack.append(v); on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            strong(v)
    return out


def scan() -> dict[str, list[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    upward, local = [], []
    for mod, path in sorted(files.items()):
        for target, line, is_local, type_checking in imports_of(path, modules):
            if target == mod or mod.startswith(target + "."):
                continue  # a package's own __init__
            if not type_checking:
                graph[mod].add(target)
            src, dst = layer_of(mod), layer_of(target)
            if src >= 0 and dst > src:
                where = f"{path.relative_to(ROOT)}:{line}" + (", under TYPE_CHECKING" if type_checking else "")
                upward.append(f"{mod} -> {target} ({where})")
            if is_local and not mod.startswith("memfit.cli"):
                local.append(f"{mod} -> {target} ({path.relative_to(ROOT)}:{line})")
    return {"cycles": [" <-> ".join(c) for c in cycles(graph)], "upward imports": upward,
            "function-local memfit imports": local}


def main() -> int:
    found = scan()
    for kind, items in found.items():
        print(f"{kind}: {len(items)}")
        for item in items:
            print(f"  {item}")
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
