"""torch's private internals that the disk cache's format relies on (``qgraph.export.stored``), each with its reason.

Alike in torch 2.10 to 2.14 (where the names differ, the helper says which is which). ``torch.export.load`` makes a
program's node values again as fake tensors over the program's size symbols, through a schema of dataclasses and a
sympy parse of every size from a string: 2 s of a fresh process for the tiny model's program, most of the first
call. The cache stores each size as an expression tree instead and makes the values the way torch's loader does,
with the pieces below, which torch only has in private modules: the shape environment that owns the symbols (their
example values and ranges), the fake-tensor mode over it, the sympy functions of torch's size arithmetic, and the
verifier of the training IR that ``torch.export.export`` produces.
"""
from __future__ import annotations

import functools

import sympy
import torch


def stored_fake_mode(symbols: dict[str, tuple[int | None, int, int | None]]):
    """A fake-tensor mode over a fresh shape environment holding ``symbols`` (``{name: (example, min,
    max)}``: a size symbol of the program, its example value and its range, ``None`` for no upper bound or no
    example), and the symbols themselves; as ``torch._export.serde``'s loader sets them up."""
    from torch._guards import SLoc
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, ValueRangesSLoc

    env = ShapeEnv(assume_static_by_default=True)
    mode = FakeTensorMode(allow_fallback_kernels=False, allow_non_fake_inputs=True, shape_env=env)
    mode.cache_enabled = False  # each value is made once (its description is new): the cache would never hit
    made = {}
    for name, (example, low, high) in symbols.items():
        symbol = sympy.Symbol(name, integer=True, positive=low >= 1, nonnegative=True)
        if example is not None:
            _add_example(env, symbol, example)
        # the range, as torch's loader sets it (constrain_symbol_range) but for where it was set: that records
        # the caller's frame, whose first lookup imports torch.export's tracer (1 s of a fresh process)
        where = SLoc("qgraph's disk cache", None)
        env._update_var_to_range(symbol, value_range(low, high), ValueRangesSLoc(where, where))
        if name.startswith("u"):  # an unbacked size (data-dependent): the environment counts them
            env.unbacked_symint_counter = max(env.unbacked_symint_counter, int(name[1:]) + 1)
        made[name] = symbol
    return mode, made


def _add_example(env, symbol, example: int) -> None:
    """Record ``symbol``'s example value: ``add_backed_var_to_val`` since torch 2.11, ``add_var_to_val``
    before (2.10)."""
    add = getattr(env, "add_backed_var_to_val", None) or env.add_var_to_val
    add(symbol, example)


def _examples(env) -> dict:
    """The example values of an environment's symbols: ``backed_var_to_val`` since torch 2.11, ``var_to_val``
    before (2.10)."""
    found = getattr(env, "backed_var_to_val", None)
    return env.var_to_val if found is None else found


def sym_int(mode, expression: sympy.Expr, example: int | None):
    """A symbolic int of ``mode``'s environment standing for ``expression`` (its example value ``example``)."""
    return mode.shape_env.create_symintnode(expression, hint=example)


@functools.cache
def size_functions() -> dict[str, type]:
    """The sympy functions torch's size expressions use, by name (``torch.utils._sympy.functions``)."""
    from torch.utils._sympy import functions
    names = ("FloorDiv", "CeilDiv", "CleanDiv", "Mod", "PythonMod", "ModularIndexing", "CeilToInt", "FloorToInt",
             "Max", "Min", "Where", "PowByNatural", "IntTrueDiv", "TruncToInt", "Identity")
    found = {name: getattr(functions, name) for name in names if hasattr(functions, name)}
    return {"Add": sympy.Add, "Mul": sympy.Mul, "Pow": sympy.Pow, **found}


def value_range(low: int, high: int | None):
    """The range ``[low, high]`` of a size symbol as ``ExportedProgram.range_constraints`` holds it (``high``
    None: unbounded)."""
    from torch.utils._sympy.numbers import int_oo
    from torch.utils._sympy.value_ranges import ValueRanges
    return ValueRanges(low, int_oo if high is None else high)


def training_verifier():
    """The verifier of ``torch.export.export``'s training IR, what a loaded program is checked against."""
    from torch._export.verifier import TrainingIRVerifier
    return TrainingIRVerifier


def symbol_range(program, symbol) -> tuple[int, int | None]:
    """``(min, max)`` of a program's size symbol (``max`` None: unbounded)."""
    from torch.utils._sympy.numbers import int_oo
    found = program.range_constraints.get(symbol)
    if found is None:
        return 0, None
    return int(found.lower), (None if found.upper == int_oo else int(found.upper))


def example_of(program, symbol) -> int | None:
    """The example value export traced ``symbol`` at, from the fake values' environment (None if none)."""
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and hasattr(value, "fake_mode") and value.fake_mode.shape_env is not None:
            found = _examples(value.fake_mode.shape_env).get(symbol)
            return None if found is None else int(found)
    return None



def lazy_graph_module(root, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule of ``graph`` that writes its Python code on first use, not when made: the programs the
    cache loads and repeats into every block are never run (qgraph's passes copy their graphs), and writing
    and compiling a module's code costs about 0.1 s a module (``torch.fx._lazy_graph_module``, private)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    return _LazyGraphModule(root, graph)


def written(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``module`` with its Python code written now (a lazy one's, ``lazy_graph_module``; a plain GraphModule's
    again), so it runs, compiles and inspects as any GraphModule."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    module.recompile()
    _LazyGraphModule.force_recompile(module)
    return module
