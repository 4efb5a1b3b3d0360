"""The import rules ruff cannot check, over qgraph/: no import cycle between packages, no underscore name
imported from another qgraph module, and a function-level import of a qgraph module only with its reason in a
comment beside it (on its line or the line above: the cycle it breaks, or what it keeps out of a first import).
Exits 1 listing each breach; also prints (not failing) the count of function-level imports and the files over
350 lines.

A node of the package graph is a subpackage (``qgraph.kernels``, its ``__init__.py`` included), a top-level
module (``qgraph.cli``), or ``qgraph`` itself (its ``__init__.py``). An edge is a module-level import: those
under ``if TYPE_CHECKING:`` never run, and a function-level one runs after every module has loaded, so
neither makes an import-time cycle. ruff's PLC2701 skips every import inside the one top-level package
(relative or absolute), hence the private-name check here.

    python .ci/imports.py [-v]      (-v lists the function-level imports too)
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent / "qgraph"
LONG = 350  # lines; the house limit is about 400


def module_name(path: Path) -> str:
    """qgraph/kernels/slot.py -> qgraph.kernels.slot; qgraph/kernels/__init__.py -> qgraph.kernels."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """The graph's node: qgraph.kernels.slot -> qgraph.kernels; qgraph.cli -> qgraph.cli; qgraph -> qgraph."""
    return ".".join(module.split(".")[:2])


class Import:
    """One imported qgraph name (or module), where it is imported and how."""

    def __init__(self, source: str, line: int, target: str, name: str | None, in_function: bool, typing_only: bool):
        self.source, self.line, self.target, self.name = source, line, target, name
        self.in_function, self.typing_only = in_function, typing_only


def _typing_only(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, modules: set[str]) -> list[Import]:
    """The qgraph imports in one file, each resolved to the module it loads."""
    found: list[Import] = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST, in_function: bool, typing_only: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function = True
        if isinstance(node, ast.If) and _typing_only(node.test):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, typing_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "qgraph":
                    found.append(Import(module, node.lineno, alias.name, None, in_function, typing_only))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if origin.split(".")[0] == "qgraph":
                for alias in node.names:
                    submodule = f"{origin}.{alias.name}"
                    if submodule in modules:  # `from . import compat`: the submodule, not a name
                        found.append(Import(module, node.lineno, submodule, None, in_function, typing_only))
                    else:
                        found.append(Import(module, node.lineno, origin, alias.name, in_function, typing_only))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function, typing_only)

    visit(ast.parse(path.read_text(), str(path)), False, False)
    return found


def _explained(path: Path, line: int) -> bool:
    """Whether the import at ``line`` has a comment on its line or a comment line just above it."""
    lines = path.read_text().splitlines()
    return "#" in lines[line - 1] or (line > 1 and lines[line - 2].strip().startswith("#"))


def main(argv: list[str]) -> int:
    paths = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    imports = [i for module, path in paths.items() for i in imports_of(module, path, set(paths))]

    where = defaultdict(dict)  # (package, package) -> {"qgraph/kernels/slot.py:21": None, ...} (ordered, once each)
    for i in imports:
        edge = (package_of(i.source), package_of(i.target))
        if not (i.in_function or i.typing_only) and edge[0] != edge[1]:
            where[edge][f"{paths[i.source].relative_to(ROOT.parent)}:{i.line}"] = None
    cycles = sorted(sorted(nx.simple_cycles(nx.DiGraph(list(where)))), key=len)

    private = [i for i in imports if i.name and i.name.startswith("_") and not i.name.startswith("__")
               and i.target != i.source]
    function_level = [i for i in imports if i.in_function]
    unexplained = sorted({(str(paths[i.source].relative_to(ROOT.parent)), i.line) for i in function_level
                          if not _explained(paths[i.source], i.line)})
    lengths = {path: len(path.read_text().splitlines()) for path in paths.values()}
    long = sorted(((n, p) for p, n in lengths.items() if n > LONG), reverse=True)

    print(f"function-level qgraph imports: {len(function_level)} (each needs its reason beside it)")
    if "-v" in argv:
        for i in function_level:
            print(f"  {paths[i.source].relative_to(ROOT.parent)}:{i.line}  {i.target}{'.' + i.name if i.name else ''}")
    print(f"files over {LONG} lines: {len(long)}")
    for n, p in long:
        print(f"  {n:4d}  {p.relative_to(ROOT.parent)}")

    for cycle in cycles:
        print("import cycle between packages: " + " -> ".join([*cycle, cycle[0]]))
        for a, b in zip(cycle, [*cycle[1:], cycle[0]]):
            print(f"  {a} -> {b}: {', '.join(where[(a, b)])}")
    for i in private:
        print(f"private name imported across modules: {paths[i.source].relative_to(ROOT.parent)}:{i.line} "
              f"imports {i.name} from {i.target}")
    for path, line in unexplained:
        print(f"function-level import without its reason: {path}:{line} (import it at the top of the module, or say "
              f"in a comment beside it which cycle it breaks or what it keeps out of a first import)")
    if cycles or private or unexplained:
        print(f"{len(cycles)} import cycle(s), {len(private)} private-name import(s) (a shared helper drops its "
              f"underscore where it is defined), {len(unexplained)} function-level import(s) without a reason")
        return 1
    print("no import cycle between packages, no private name imported across modules, every function-level "
          "import with its reason")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
