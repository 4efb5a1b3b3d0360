"""The private torch / transformers internals qgraph relies on, and the differences between the
releases it supports, each with its reason.

Every use of a private attribute lives here, so a torch or transformers upgrade breaks in one
place. A difference between supported releases is told by feature detection (does this function,
attribute or argument exist?), never by comparing version strings. ``TESTED`` holds the ranges the
tests ran on (README "Supported versions"); ``check_versions`` refuses a release older than a
range's floor and warns about one newer than its top.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import re
import warnings
from importlib import metadata

import torch
from torch._C import DispatchKey
from torch.export import ExportedProgram
from torch.nn.modules import module as _module

from .errors import UnsupportedModel

# The releases the tests ran on: (floor, newest tested), as major.minor. Below the floor qgraph
# does not import (an ImportError names the floor); past the newest it imports with a warning.
# transformers' floor is 5.23, the first whose gated DeltaNet hands its kernel the queries and keys
# num_k_heads wide (the kernel repeats them to the value heads): before, the module repeats them
# first, so the kernel's arguments, which qgraph's attention_queries / attention_keys are, would be
# num_v_heads wide. Older releases differ further (README "Supported versions").
TESTED = {"torch": ("2.13", "2.14"), "transformers": ("5.23", "5.24")}


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string ("2.14.1+cu130" -> (2, 14, 1))."""
    return tuple(int(part) for part in re.findall(r"\d+", re.match(r"[\d.]*", version).group()))


def check_versions() -> None:
    """Raise ImportError naming the floor if torch or transformers is older than the tested range;
    warn (one line naming the tested ranges) if either is newer."""
    ranges = ", ".join(f"{package} {low}-{high}" for package, (low, high) in TESTED.items())
    for package, (low, high) in TESTED.items():
        installed = metadata.version(package)
        release = _release(installed)
        if release[:2] < _release(low):
            raise ImportError(f"qgraph needs {package} >= {low} (it uses {package} internals listed in "
                              f"qgraph/compat.py); {installed} is installed: pip install '{package}>={low}'")
        if release[:2] > _release(high):
            warnings.warn(f"qgraph was tested with {ranges}; {package} {installed} is newer and untested",
                          UserWarning, stacklevel=2)


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
    """Let inductor order symbolic strides with the graph's shape env (pytorch/pytorch#185510).

    With grad enabled, the forward graph returns the activations the backward reads, some of them
    views with symbolic strides (``64 * seq`` and ``64``); the inductor of torch 2.13 and 2.14 sorts those
    without its shape env and fails with "cannot determine truth value of Relational: 1 < s53". This does
    what the upstream fix (pytorch/pytorch#185871) does: sort them with the active graph's shape env.
    """
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    original = ir.get_fill_order
    if getattr(original, "qgraph_fix", False):
        return

    def get_fill_order(seq, shape_env=None):
        if shape_env is None and not all(isinstance(s, int) or getattr(s, "is_Integer", False) for s in seq):
            try:
                shape_env = V.graph.sizevars.shape_env
            except (AttributeError, AssertionError):
                pass  # no graph being lowered: as before
        return original(seq, shape_env)

    get_fill_order.qgraph_fix = True
    ir.get_fill_order = get_fill_order


# -- building programs (qgraph.export.repeat, qgraph.export.disk_cache) -------------------------------------------------
# Alike in torch 2.13 and 2.14. torch.export has no public way to make an ExportedProgram from
# an edited graph with a new signature, state dict or constants (repeated blocks; weights swapped
# for placeholders before saving), so we call its constructor, which is not a documented entry
# point and whose keywords have changed between releases (one ``verifier`` became ``verifiers``).
def exported_program(root, graph: torch.fx.Graph, signature, state_dict: dict, range_constraints: dict,
                     module_call_graph: list, constants: dict, verifier) -> ExportedProgram:
    """An ExportedProgram of ``graph`` (owned by ``root``, a GraphModule) with no example inputs."""
    return ExportedProgram(root=root, graph=graph, graph_signature=signature, state_dict=state_dict,
                           range_constraints=range_constraints, module_call_graph=module_call_graph,
                           example_inputs=None, constants=constants, verifiers=[verifier])


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


# -- attention implementation (qgraph.export.fingerprint, qgraph.export.disk_cache, qgraph.export) ----------------------
# Alike in transformers 5.23 and 5.24. A config's attention implementation ("sdpa", "eager",
# ...) is only exposed as ``config._attn_implementation`` (a property over
# ``_attn_implementation_internal``, whose setter also sets every sub-config's).
def attn_implementation(config) -> str | None:
    """``config``'s attention implementation (None when ``config`` is None or has none)."""
    return getattr(config, "_attn_implementation", None)


@contextlib.contextmanager
def attn_implementation_set(config, value: str | None):
    """Set ``config``'s own attention implementation (not its sub-configs') for the block, then put
    the previous one back."""
    original = config._attn_implementation_internal
    config._attn_implementation_internal = value
    try:
        yield
    finally:
        config._attn_implementation_internal = original


# -- experts implementation (qgraph.families.qwen_moe, qgraph.kernels.experts, qgraph.export.fingerprint) ------------
# Alike in transformers 5.23 and 5.24. A config's experts implementation ("eager", "grouped_mm",
# "batched_mm", ...) is only exposed as ``config._experts_implementation``. transformers runs a
# non-eager one with its function in ``integrations.moe.ALL_EXPERTS_FUNCTIONS``, which takes the
# experts module as ``self`` and reads its weights and the flags ``use_experts_implementation`` sets
# (``has_gate``, ..., the private ``_is_expert_parallel`` and ``_apply_gate``): qgraph's experts op
# hands it a stand-in (``_Experts``) holding the op's tensors. A release without that interface
# has no implementation but the modules' own eager loop: the op then runs "eager".
_EXPERTS_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                   "has_post_expert_norm": False}  # what qgraph's experts op takes: [experts 2*inner hidden] gate|up


def experts_implementation(config) -> str | None:
    """``config``'s experts implementation (None when ``config`` is None or has none)."""
    return getattr(config, "_experts_implementation", None)


@functools.lru_cache(maxsize=None)
def _experts_functions():
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    return getattr(moe, "ALL_EXPERTS_FUNCTIONS", None)


def experts_implementation_run(experts: torch.nn.Module) -> str:
    """The implementation qgraph's experts op runs for the experts module ``experts``: its config's, as
    transformers dispatches on it; "eager" when it names none, or (warned) transformers has no experts
    interface. ``UnsupportedModel`` when qgraph cannot run it."""
    name = experts_implementation(getattr(experts, "config", None)) or "eager"
    functions = _experts_functions()
    if name != "eager" and functions is None:
        warnings.warn(f"qgraph: this transformers has no experts interface (integrations.moe.ALL_EXPERTS_FUNCTIONS): "
                      f"the experts implementation {name!r} runs as 'eager'", stacklevel=3)
        return "eager"
    layout = {flag: getattr(experts, flag, None) for flag in _EXPERTS_LAYOUT}
    if name != "eager" and (name not in functions or layout != _EXPERTS_LAYOUT):
        raise UnsupportedModel(f"qgraph's experts op cannot run the experts implementation {name!r} (registered: "
                               f"{', '.join(functions)}) of experts with {layout} (it runs {_EXPERTS_LAYOUT}): "
                               f"set another with model.set_experts_implementation(...)")
    return name


class _Experts:
    """An experts module in ``_EXPERTS_LAYOUT`` holding the given tensors, in one process (no expert
    parallelism), as transformers' experts functions read it (``self``)."""

    _is_expert_parallel = False

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act_fn):
        vars(self).update(_EXPERTS_LAYOUT)
        self.gate_up_proj, self.down_proj, self.act_fn = gate_up_proj, down_proj, act_fn
        self.num_experts = len(down_proj)

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        from transformers.integrations.moe import _default_apply_gate  # what use_experts_implementation installs
        return _default_apply_gate(self, gate_up_out)


def run_experts(name: str, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act_fn) -> torch.Tensor:
    """transformers' experts function ``name`` on ``hidden`` [tokens hidden] and its top-k experts and weights
    [tokens top_k]: the routed experts' weighted sum [tokens hidden], as the model's experts compute it."""
    return _experts_functions()[name](_Experts(gate_up_proj, down_proj, act_fn), hidden, top_k_index, top_k_weights)


# -- HF generation settings (qgraph.generate) -------------------------------------------------------
# Alike in transformers 5.23 and 5.24. qgraph's decoding loop applies HF's own rules for
# generation settings (the model's generation_config merged with keyword arguments and validated;
# eos / pad tensors; temperature, top_k, min_new_tokens, ... as logits processors), which
# ``generate`` builds with these private GenerationMixin methods and exposes no other way.
def generation_config(model, **kwargs):
    """``model``'s generation config with ``kwargs`` applied and validated, as HF ``generate`` makes it."""
    config, _ = model._prepare_generation_config(None, **kwargs)
    return config


def logits_processors(model, config, prompt_ids: torch.Tensor):
    """HF's logits processors for ``config`` and a prompt of ``prompt_ids``; first sets the
    config's special-token tensors (the eos tensor the min-length rules read), as ``generate`` does."""
    from transformers.generation.logits_process import LogitsProcessorList

    model._prepare_special_tokens(config, True, device=prompt_ids.device)
    return model._get_logits_processor(config, input_ids_seq_length=prompt_ids.shape[1],
                                       encoder_input_ids=prompt_ids, logits_processor=LogitsProcessorList(),
                                       device=prompt_ids.device, model_kwargs={})


def generation_settings() -> dict:
    """Every HF generation setting (a public field of ``GenerationConfig``) with its default: HF's
    default value where it keeps one apart from the field's blank value, which ``generate`` compares a
    setting with to tell a setting left alone from one asked for."""
    from transformers import GenerationConfig

    blank = GenerationConfig()
    defaults = GenerationConfig._get_default_generation_params()
    return {name: defaults.get(name, value) for name, value in vars(blank).items()
            if not name.startswith("_") and name != "transformers_version"}


# -- reading and running ops (qgraph.render.labels, qgraph.compile) ---------------------------------
# Alike in torch 2.13 and 2.14. An op's argument names are only on its schema (``_schema``,
# public in practice but underscored); and a compiled program's dynamic dims are marked with dynamo's
# ``maybe_mark_dynamic`` (``torch.compiler`` has no public counterpart), so the first call with a new
# batch or length does not recompile.
def op_argument_names(op) -> list[str]:
    """The names of an ATen or custom op's arguments, in order."""
    return [argument.name for argument in op._schema.arguments]


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Tell torch.compile that ``tensor``'s ``dim`` varies between calls (no recompile when it does)."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


# -- buffers a module computes from its config (qgraph.instrument's load_weights) ----------------------
# Alike in transformers 5.23 and 5.24. A rotary embedding computes ``inv_freq`` (and
# ``original_inv_freq``) from the config in ``__init__`` and keeps it out of checkpoints
# (non-persistent); a model built on the meta device holds it on meta. transformers recomputes it in
# its private loading path; qgraph constructs the module's class again from the module's config.
def computed_buffers(module: torch.nn.Module, device) -> dict[str, torch.Tensor]:
    """The buffers ``module`` computes from its config, computed on ``device`` (``{}`` when it has no config)."""
    config = getattr(module, "config", None)
    if config is None:
        return {}
    with torch.device(device):
        fresh = type(module)(config=config)
    return dict(fresh.named_buffers())


# -- the Qwen ViT's grid-dependent inputs (qgraph.families.qwen_vision) -----------------------------
# The Qwen ViT computes from the image grids, with Python loops (``.tolist()``) that export cannot
# follow, the attention's ``cu_seqlens``, the rotary's position ids and the indices and weights that
# resample its learned position table to each grid; its forward takes each one precomputed instead,
# popped from its keyword arguments under these names. The image-text program takes them as inputs,
# computed before each call by the functions that forward calls (``transformers.vision_utils``), so
# they are its own values. (transformers 5.9 to 5.14 took the resampling as ``bilinear_*`` [4,
# patches] and 5.2 to 5.8 took nothing precomputed: both are below the floor, see ``TESTED``.)
def vision_inputs(visual: torch.nn.Module, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ViT ``visual``'s grid-dependent inputs for ``grid_thw``, as its forward computes them:
    ``cu_seqlens``, ``position_ids``, ``interp_indices`` and ``interp_weights`` (``[patches, taps]``)."""
    from transformers import vision_utils

    merge = visual.config.spatial_merge_size
    indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=merge)
    return {"cu_seqlens": vision_utils.get_vision_cu_seqlens(grid_thw),
            "position_ids": vision_utils.get_vision_position_ids(grid_thw, merge),
            "interp_indices": indices, "interp_weights": weights}


# -- forwards transformers runs under torch.no_grad (qgraph.export.trace) ---------------------------
# transformers up to 5.23 decorates its rotary embeddings' forward (the text and the vision one) with
# ``@torch.no_grad()``; 5.24 does not. Exported, such a forward becomes a
# ``wrap_with_set_grad_enabled`` higher-order op, which torch.compile refuses (the program's symbolic
# sizes are free variables of the wrapped graph) and which a model on the meta device cannot run with
# weights from elsewhere. Whether a forward is so decorated is read off torch's decorator (a
# ``functools.wraps`` wrapper whose closure holds the ``torch.no_grad`` instance it enters). While
# exporting, each such class's forward is its undecorated function with every tensor it returns
# detached: the same values, and no gradient flows through its outputs, as under no_grad.
def _under_no_grad(forward):
    """The function ``forward`` runs under ``torch.no_grad`` (its ``@torch.no_grad()``), or None."""
    inner = getattr(forward, "__wrapped__", None)
    cells = getattr(forward, "__closure__", None) or ()
    entered = (getattr(_cell(cell), "__self__", None) for cell in cells)  # torch.no_grad().clone, bound
    return inner if inner is not None and any(isinstance(context, torch.no_grad) for context in entered) else None


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


@contextlib.contextmanager
def export_patches(model: torch.nn.Module):
    """While exporting ``model``: the forwards of its module classes that transformers decorates with
    ``@torch.no_grad()`` run undecorated, their returned tensors detached (the classes' forwards are
    restored afterwards)."""
    owners = {next(klass for klass in type(module).__mro__ if "forward" in vars(klass)) for module in model.modules()}
    saved = {cls: vars(cls)["forward"] for cls in owners if _under_no_grad(vars(cls)["forward"]) is not None}
    for cls, forward in saved.items():
        cls.forward = _detached(_under_no_grad(forward))
    try:
        yield
    finally:
        for cls, forward in saved.items():
            cls.forward = forward


def _detached(forward):
    @functools.wraps(forward)
    def detached(*args, **kwargs):
        return torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, forward(*args, **kwargs))
    return detached


# -- symbolic sizes (qgraph.distributed.engine) --------------------------------------------------------
# Alike in torch 2.13 and 2.14. torch's pipeline stages take the shapes of what crosses between
# processes before they run; qgraph computes them, for each call's batch and length, from the sizes the
# exported graph records (SymInts), whose expression (sympy) is only reachable as ``SymInt.node.expr``.
def size_expression(size):
    """The sympy expression of a symbolic size (a plain int stays an int)."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


# -- fake tensors with symbolic sizes (qgraph.saved.sandbox) -----------------------------------------
# Alike in torch 2.13 and 2.14. The sandbox runs an untrusted graph on fake tensors (shapes, no data) to
# know every tensor it can make before anything real runs; FakeTensorMode is only in torch._subclasses.
def fake_mode():
    """A fake-tensor mode over a fresh shape environment (every size symbolic where asked)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    return FakeTensorMode(shape_env=ShapeEnv())


def fake(mode, tensor: torch.Tensor, dynamic: bool):
    """``tensor`` as a fake of ``mode``: every dim a fresh symbol (equal sizes one symbol) if ``dynamic``."""
    if not dynamic:
        return mode.from_tensor(tensor, static_shapes=True)
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * tensor.dim())
    return mode.from_tensor(tensor, symbolic_context=context)
