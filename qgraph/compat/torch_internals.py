"""torch's private internals that qgraph relies on, each with its reason (see ``qgraph.compat``)."""
from __future__ import annotations

import contextlib
import copy
import functools
import threading

import torch
from torch._C import DispatchKey
from torch.export import ExportedProgram
from torch.nn.modules import module as _module

from ..errors import QgraphError
from .torch_stored import lazy_graph_module


# nn.Module keeps its hooks in these dicts, and torch the global module hooks in module-level dicts;
# torch has no public way to list or set hooks aside. Export must not trace the user's hooks (they
# would be baked into the program and copied to every repeated block), so they are set aside while
# it traces and put back after.
_MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                      "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
                      "_backward_pre_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_hooks_with_kwargs",
                      "_global_forward_hooks_always_called", "_global_forward_pre_hooks",
                      "_global_backward_hooks", "_global_backward_pre_hooks")


def _hook_dicts(model: torch.nn.Module):
    for module in model.modules():
        for attribute in _MODULE_HOOK_DICTS:
            hooks = getattr(module, attribute, None)
            if hooks:
                yield hooks
    for attribute in _GLOBAL_HOOK_DICTS:
        hooks = getattr(_module, attribute, None)
        if hooks:
            yield hooks


def hooked_modules(model: torch.nn.Module) -> list[str]:
    """The paths of ``model``'s modules that carry forward or backward hooks ("<global>" for
    torch's global module hooks)."""
    paths = [path or type(model).__name__ for path, module in model.named_modules()
             if any(getattr(module, attribute, None) for attribute in _MODULE_HOOK_DICTS
                    if attribute != "_forward_hooks_always_called")]
    if any(getattr(_module, attribute, None) for attribute in _GLOBAL_HOOK_DICTS):
        paths.append("<global>")
    return paths


@contextlib.contextmanager
def hooks_set_aside(model: torch.nn.Module):
    """Empty every hook dict of ``model`` (and the global ones) in place for the block, then put
    each hook back where it was (same dicts, same order, so the user's handles stay valid). The
    dicts are emptied in place because twins made with ``copy.copy`` share them."""
    saved = [(hooks, dict(hooks)) for hooks in _hook_dicts(model)]
    for hooks, _ in saved:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, items in saved:
            ours = dict(hooks)  # hooks registered inside the block and not removed: keep them after the user's
            hooks.clear()
            hooks.update(items)
            hooks.update(ours)


# -- autograd inside a custom op (qgraph.kernels.grad) ---------------------------------------------
# A custom op's backward recomputes its forward under autograd. The dispatcher runs a custom op's
# kernel with the autograd keys excluded, and torch has no public way to record autograd there, so
# the exclusion is lifted with its private TLS guard.

# The keys a custom op's implementation runs without (it is called below the autograd layer).
_AUTOGRAD_KEYS = (DispatchKey.AutogradFunctionality, DispatchKey.AutogradOther, DispatchKey.AutogradNestedTensor,
                  DispatchKey.ADInplaceOrView)


@contextlib.contextmanager
def autograd_enabled():
    """Record autograd inside a custom op's implementation.

    The dispatcher calls a custom op's kernel with the autograd keys excluded (and grad mode off in
    a backward), so plain ``torch.enable_grad()`` records nothing there; this lifts the exclusion
    for the block as well.
    """
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        excluded = excluded.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        yield


# -- torch.compile with grad enabled (qgraph.compile) --------------------------------------------
def inductor_symbolic_strides_fix() -> None:
    """Let inductor order symbolic strides with the graph's shape env (pytorch/pytorch#185510), and lower
    the conv's backward without specialising the length (``_conv_backward_keeps_sizes_symbolic``).

    With grad enabled, the forward graph returns the activations the backward reads, some of them
    views with symbolic strides (``64 * seq`` and ``64``); the inductor of torch 2.13 and 2.14 sorts those
    without its shape env and fails with "cannot determine truth value of Relational: 1 < s53". This does
    what the upstream fix (pytorch/pytorch#185871) does: sort them with the active graph's shape env.
    """
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    original = ir.get_fill_order
    if not getattr(original, "qgraph_fix", False):
        def get_fill_order(seq, shape_env=None):
            if shape_env is None and not all(isinstance(s, int) or getattr(s, "is_Integer", False) for s in seq):
                try:
                    shape_env = V.graph.sizevars.shape_env
                except (AttributeError, AssertionError):
                    pass  # no graph being lowered: as before
            return original(seq, shape_env)

        get_fill_order.qgraph_fix = True  # type: ignore[attr-defined]  # a marker on the function: patched once
        ir.get_fill_order = get_fill_order
    _conv_backward_keeps_sizes_symbolic()


def _conv_backward_keeps_sizes_symbolic() -> None:
    """Let inductor lower ``convolution_backward`` without fixing the sequence length.

    With grad enabled, the backward of the DeltaNet's causal conv is compiled with the forward, and the
    lowering of torch 2.13 orders the gradient's strides (``[channels * seq, seq, 1]``) through
    ``sizevars.guard_int_seq``, which specialises ``seq`` to the length of the first call: every new
    length compiled again (past dynamo's cache limit, eagerly). The strides are ordered as they are,
    symbolically (``get_fill_order`` above), and only sizes that are numbers are made ints.
    """
    from torch._inductor.lowering import lowerings
    from torch._inductor.virtualized import V

    target = torch.ops.aten.convolution_backward.default
    original = lowerings.get(target)
    if original is None or getattr(original, "qgraph_fix", False):
        return

    def ints_where_static(seq):
        return [int(size) if isinstance(size, int) or getattr(size, "is_Integer", False) else size for size in seq]

    def convolution_backward(*args, **kwargs):
        sizevars = V.graph.sizevars
        sizevars.guard_int_seq = ints_where_static  # the instance's, for this lowering only
        try:
            return original(*args, **kwargs)
        finally:
            del sizevars.guard_int_seq

    convolution_backward.qgraph_fix = True  # type: ignore[attr-defined]  # a marker on the function: patched once
    lowerings[target] = convolution_backward


# -- building programs (qgraph.export.repeat, qgraph.export.disk_cache) ------------------------------------------------
# Alike in torch 2.13 and 2.14. torch.export has no public way to make an ExportedProgram from
# an edited graph with a new signature, state dict or constants (repeated blocks; weights swapped
# for placeholders before saving), so we call its constructor, which is not a documented entry
# point and whose keywords have changed between releases (one ``verifier`` became ``verifiers``).
def exported_program(root, graph: torch.fx.Graph, signature, state_dict: dict, range_constraints: dict,
                     module_call_graph: list, constants: dict, verifier) -> ExportedProgram:
    """An ExportedProgram of ``graph`` (owned by ``root``, a GraphModule) with no example inputs. Its
    graph module writes its code on first use (``torch_stored.lazy_graph_module``): qgraph's passes copy
    the graph and never run it, and the constructor's ``torch.fx.GraphModule`` would write and compile
    the code of every block (``_create_graph_module_for_export``, replaced while it runs, under the
    tracing lock so no other thread's export sees it)."""
    module = torch.export.exported_program
    with _TRACING:
        made = module._create_graph_module_for_export
        module._create_graph_module_for_export = lazy_graph_module
        try:
            return ExportedProgram(root=root, graph=graph, graph_signature=signature, state_dict=state_dict,
                                   range_constraints=range_constraints, module_call_graph=module_call_graph,
                                   example_inputs=None, constants=constants, verifiers=[verifier])
        finally:
            module._create_graph_module_for_export = made


# -- shallow twins of a model (qgraph.export.repeat) --------------------------------------------------------
# Alike in torch 2.13 and 2.14. The seed export traces a twin of the model whose layer list
# holds only the seed blocks, without touching the model. ``copy.copy`` of a module shares its child
# dict (``nn.Module._modules``), and torch has no public way to give a copy its own; children are
# put in that dict directly, as ``setattr`` would also run torch's global module registration hooks.
def own_children(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` (a shallow copy) given its own child dict, so replacing a child leaves the original's."""
    module._modules = dict(module._modules)
    return module


def shallow_twin(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` with its own child dict (its children are the module's)."""
    return own_children(copy.copy(module))


def replace_child(parent: torch.nn.Module, name: str, replace) -> torch.nn.Module:
    """Set ``parent``'s child ``name`` to ``replace(child)`` in its child dict; returns the new child."""
    child = parent._modules[name] = replace(parent._modules[name])
    return child


# -- reading and running ops (qgraph.render.labels, qgraph.compile, qgraph.saved) -----------------------
# Alike in torch 2.13 and 2.14. An op's argument names are only on its schema (``_schema``,
# public in practice but underscored); and a compiled program's dynamic dims are marked with dynamo's
# ``maybe_mark_dynamic`` (``torch.compiler`` has no public counterpart), so the first call with a new
# batch or length does not recompile.
def op_schema(op) -> torch.FunctionSchema:
    """An ATen or custom op's schema: its arguments (names, defaults, which it writes) and returns."""
    return op._schema


def op_argument_names(op) -> list[str]:
    """The names of an ATen or custom op's arguments, in order."""
    return [argument.name for argument in op._schema.arguments]


# ``OpOverload.__call__`` is ``return self._op(*args, **kwargs)`` (torch 2.10 to 2.14): ``_op`` is the
# overload's C++ entry point, and calling it skips a Python frame per op (``qgraph.direct``). Where a
# torch's ``__call__`` reads more than ``_op`` (or the overload is a subclass with a call of its own),
# the overload itself is kept.
_OVERLOAD = type(torch.ops.aten.add.Tensor)
_PLAIN_CALL = _OVERLOAD.__call__.__code__.co_names == ("_op",)


def op_entry(op):
    """What calling the op overload ``op`` calls, with the same arguments: its C++ entry point where
    torch's call does nothing more, else ``op`` itself."""
    return op._op if _PLAIN_CALL and type(op) is _OVERLOAD else op


def mark_dynamic(tensor: torch.Tensor, dims: list[int]) -> None:
    """Tell torch.compile that ``tensor``'s ``dims`` vary between calls (no recompile when they do)."""
    torch._dynamo.maybe_mark_dynamic(tensor, dims)



# -- symbolic sizes (qgraph.distributed.engine) --------------------------------------------------------
# Alike in torch 2.13 and 2.14. torch's pipeline stages take the shapes of what crosses between
# processes before they run; qgraph computes them, for each call's batch and length, from the sizes the
# exported graph records (SymInts), whose expression (sympy) is only reachable as ``SymInt.node.expr``.
def size_expression(size):
    """The sympy expression of a symbolic size (a plain int stays an int)."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


# -- one trace at a time --------------------------------------------------------------------------------
# Alike in torch 2.13 and 2.14. torch.export and a fake-tensor run over symbolic sizes are not thread-safe:
# a trace keeps process-wide state that a trace in another thread reads, replaces or clears (the proxy
# mode's slot, export's module hierarchy, the tracer each symbolic size belongs to), so two at once fail
# ("Trying to pop empty mode stack", "ProxyTorchDispatchMode slot already occupied", "s26 ... is not
# tracked with proxy"). Every export and fake run of qgraph's holds this one lock (``export`` below, a
# function edit's export and check in serve/function.py, the sandbox's fake run, ig.save's exports);
# reentrant, as an export may check what it made inside it.
_TRACING = threading.RLock()


def tracing() -> threading.RLock:
    """The lock every trace holds (``with compat.tracing(): ...``): one export or fake run at a time."""
    return _TRACING


# -- fake tensors with symbolic sizes (qgraph.saved.sandbox) -----------------------------------------
# Alike in torch 2.13 and 2.14. The sandbox runs an untrusted graph on fake tensors (shapes, no data) to
# know every tensor it can make before anything real runs; FakeTensorMode is only in torch._subclasses.
def fake_mode():
    """A fake-tensor mode over a fresh shape environment (every size symbolic where asked), without torch's
    per-op dispatch cache: the sandbox runs each kind of call once and reuses its result itself, so torch's
    cache would never hit and its bookkeeping cost about a third of each call (``cache_enabled``: a plain
    attribute of the mode, read at each dispatch)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    mode = _counting_fake_mode()(shape_env=ShapeEnv())
    mode.cache_enabled = False
    return mode


@functools.cache
def _counting_fake_mode():
    """``FakeTensorMode`` counting the ops it runs (``dispatches``: each op of an op's decomposition too),
    a measure of a fake run's work that does not depend on the machine (``saved.budget``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Counting(FakeTensorMode):
        dispatches = 0

        def dispatch(self, func, types, args=(), kwargs=None):
            self.dispatches += 1
            return super().dispatch(func, types, args, {} if kwargs is None else kwargs)

    return Counting


def size_hint(size) -> int | None:
    """The example value of a size in a fake run (a plain int is its own; None if torch has none)."""
    return size if isinstance(size, int) else size.node.hint


def fake_call(target, args, kwargs):
    """``target(*args, **kwargs)`` on fake tensors, with torch's Python dispatcher on: an op torch
    implements by composing others (``aten.matmul``, ``aten.linear``, ``aten.einsum``) runs as its Python
    decomposition, whose shape rules are written for symbolic sizes, as export traced it. Without it the
    C++ composite runs: torch up to 2.12's ``matmul`` there fixes every symbolic size of a 4-d product to
    its example (a silent guard: the sandbox would bound the example call, not every call) and fails on a
    3-d by 2-d one ("Cannot call numel() on tensor with symbolic sizes"); 2.13's keeps them symbolic, so
    the dispatcher changes nothing there. (``torch._dispatch.python`` is private; the decompositions are
    torch's own.)"""
    from torch._dispatch.python import enable_python_dispatcher
    with enable_python_dispatcher():
        return target(*args, **kwargs)


def fake(mode, tensor: torch.Tensor, dynamic):
    """``tensor`` as a fake of ``mode``: every dim a fresh symbol (equal sizes one symbol) if ``dynamic``
    is True, none if False; a list of flags, one per dim, makes only those dims symbols."""
    flags = [bool(dynamic)] * tensor.dim() if isinstance(dynamic, bool) else list(dynamic)
    if not any(flags):
        return mode.from_tensor(tensor, static_shapes=True)
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if flag else DimDynamic.STATIC
                                                      for flag in flags])
    return mode.from_tensor(tensor, symbolic_context=context)


# -- dims that export can solve (qgraph.export.trace) ------------------------------------------------
# torch up to 2.12 cannot prove ``min(16*s, 32*s) == 16*s`` for a named Dim ``s >= 1``, a guard that
# reshaping a repeated tensor (``repeat_kv``'s expand + reshape, in every attention) adds, and export
# refuses the dims ("Constraints violated"); 2.13 proves it. Told by exporting that reshape once: where
# it fails, each named dim becomes ``Dim.DYNAMIC`` with the same bounds (export then keeps the guard
# without asking it to hold for every size; the sizes stay symbolic, equal ones one symbol).
@functools.cache
def _named_dims_solve_repeats() -> bool:
    class Repeat(torch.nn.Module):
        def forward(self, x):
            batch, heads, seq, dim = x.shape
            return x[:, :, None].expand(batch, heads, 2, seq, dim).reshape(batch, heads * 2, seq, dim)

    from torch._dynamo.exc import UserError
    try:
        with _TRACING:
            torch.export.export(Repeat(), (torch.zeros(2, 2, 5, 16),), strict=False,
                                dynamic_shapes=({0: torch.export.Dim("b", min=1), 2: torch.export.Dim("s", min=1)},))
    except UserError:
        return False
    return True


def export_dims(dynamic_shapes, named: bool | None = None):
    """``dynamic_shapes`` as this torch's export can take them (see above): unchanged, or each named
    Dim a ``Dim.DYNAMIC`` with its bounds (``named=False`` asks for that whatever the probe says)."""
    if named is None:
        named = _named_dims_solve_repeats()
    if named:
        return dynamic_shapes
    kind = type(torch.export.Dim("named"))  # what ``Dim(name)`` makes (``Dim.DYNAMIC`` is a hint, not one)

    def dynamic(dim):
        return torch.export.Dim.DYNAMIC(min=dim.min, max=dim.max) if isinstance(dim, kind) else dim
    return torch.utils._pytree.tree_map(dynamic, dynamic_shapes, is_leaf=lambda dim: isinstance(dim, kind))


# torch 2.13 and 2.14 have the switch (2.10 has none: there export records them). Export records each
# node's Python stack (``node.meta["stack_trace"]``): a captured traceback symbolized per node, about a
# tenth of a fresh export of the tiny model. qgraph never reads it (nodes are found by module scope), so
# qgraph's exports skip it through torch.fx's own switch, set while the export runs (under the tracing
# lock) and put back.
@contextlib.contextmanager
def _no_stack_traces():
    from torch.fx import config
    before = getattr(config, "do_not_emit_stack_traces", False)
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def export(module: torch.nn.Module, kwargs: dict, dynamic_shapes, named: bool = True) -> ExportedProgram:
    """``torch.export.export(module, (), kwargs, strict=False)`` over ``dynamic_shapes`` (``export_dims``).
    Where named dims fail for another reason the probe cannot see (torch 2.13 with transformers 5.9:
    the ViT's derived patch dims fail export's range check, "tgt_bound ... not a subset of src_bound"),
    the export runs once more with ``Dim.DYNAMIC`` dims; if that fails too, the first error is raised.
    ``named=False`` (a family whose named dims are known to fail: ``Family.named_dims``) exports with
    ``Dim.DYNAMIC`` dims at once, the trace that would follow the failed one. One at a time (``tracing``)."""
    with _TRACING, _no_stack_traces():
        named = named and _named_dims_solve_repeats()
        try:
            return torch.export.export(module, (), kwargs, dynamic_shapes=export_dims(dynamic_shapes, named),
                                       strict=False)
        except QgraphError:
            raise  # qgraph's own refusal while tracing: not a matter of dims
        except Exception as error:
            if not named:
                raise
            try:
                return torch.export.export(module, (), kwargs, dynamic_shapes=export_dims(dynamic_shapes, False),
                                           strict=False)
            except Exception:  # noqa: BLE001 (the named dims' error says more)
                raise error from None
