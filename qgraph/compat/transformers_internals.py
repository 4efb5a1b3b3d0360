"""transformers' private internals that qgraph relies on, each with its reason (see ``qgraph.compat``)."""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

import torch

from ..errors import UnsupportedModel


# -- attention implementation (qgraph.export.fingerprint, qgraph.export.disk_cache, qgraph.export) ---------------------
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


@functools.cache
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
    # a flag an older release does not set is a feature it does not have: as the layout wants it
    layout = {flag: getattr(experts, flag, wanted) for flag, wanted in _EXPERTS_LAYOUT.items()}
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
    [tokens top_k]: the routed experts' weighted sum [tokens hidden], as the model's experts compute it. The
    function gets a copy of the indices: transformers 5.9's ``batched_mm`` clamps them in place (its
    expert-parallel sentinels; valid ids unchanged), which writes into the op's input (its schema says it
    writes nothing: autograd's saved indices were changed, and opcheck refuses it)."""
    return _experts_functions()[name](_Experts(gate_up_proj, down_proj, act_fn), hidden, top_k_index.clone(),
                                      top_k_weights)


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
# they are its own values. transformers 5.9 to 5.14 take the resampling as ``bilinear_indices`` /
# ``bilinear_weights`` ``[4, patches]`` (told by ``vision_utils`` lacking the ``interp`` function): the
# program keeps 5.15's ``interp_*`` ``[patches, 4]`` (the patches first, as every image input) and the
# ViT is handed their transposes, the same numbers (5.2 to 5.8 took nothing precomputed).
def vision_inputs(visual: Any, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ViT ``visual``'s grid-dependent inputs for ``grid_thw``, as its forward computes them:
    ``cu_seqlens``, ``position_ids``, ``interp_indices`` and ``interp_weights`` (``[patches, taps]``).
    ``visual`` is typed ``Any``: the plain attributes it is read for (its grid side, interpolation mode)
    are set in its ``__init__``, which torch's stubs type as tensors or modules."""
    from transformers import vision_utils

    merge = visual.config.spatial_merge_size
    if hasattr(vision_utils, "get_vision_interpolation_indices_and_weights"):
        indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=merge)
    else:
        indices, weights = (tensor.T.contiguous() for tensor in vision_utils.get_vision_bilinear_indices_and_weights(
            grid_thw, num_grid_per_side=visual.num_grid_per_side, spatial_merge_size=merge))
    return {"cu_seqlens": vision_utils.get_vision_cu_seqlens(grid_thw),
            "position_ids": vision_utils.get_vision_position_ids(grid_thw, merge),
            "interp_indices": indices, "interp_weights": weights}


def vision_forward_kwargs(kwargs: dict) -> dict:
    """``vision_inputs``' tensors as this transformers' ViT forward takes them (see above)."""
    from transformers import vision_utils

    if hasattr(vision_utils, "get_vision_interpolation_indices_and_weights") or "interp_indices" not in kwargs:
        return kwargs
    kwargs = dict(kwargs)
    kwargs["bilinear_indices"] = kwargs.pop("interp_indices").T
    kwargs["bilinear_weights"] = kwargs.pop("interp_weights").T
    return kwargs


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
def export_patches(model: torch.nn.Module, methods: dict):
    """While exporting ``model``: the forwards of its module classes that transformers decorates with
    ``@torch.no_grad()`` run undecorated, their returned tensors detached, and each class that defines a
    method named in ``methods`` (a family's ``export_methods``: what some releases define and export
    cannot follow) runs the function given instead; the classes' functions are restored afterwards."""
    owners = {next(klass for klass in type(module).__mro__ if "forward" in vars(klass)) for module in model.modules()}
    patched = {cls: {"forward": _detached(_under_no_grad(vars(cls)["forward"]))} for cls in owners
               if _under_no_grad(vars(cls)["forward"]) is not None}
    for module in model.modules():
        for cls in type(module).__mro__:
            for name, function in methods.items():
                if name in vars(cls):
                    patched.setdefault(cls, {})[name] = function
    saved = {cls: {name: vars(cls)[name] for name in functions} for cls, functions in patched.items()}
    for cls, functions in patched.items():
        for name, function in functions.items():
            setattr(cls, name, function)
    try:
        yield
    finally:
        for cls, functions in saved.items():
            for name, function in functions.items():
                setattr(cls, name, function)


def _detached(forward):
    @functools.wraps(forward)
    def detached(*args, **kwargs):
        return torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, forward(*args, **kwargs))
    return detached



# -- kernels bound to each module (qgraph.export.trace) ---------------------------------------------
# transformers 5.9 to 5.14 bind the gated DeltaNet's kernels to each module when it is built
# (``self.chunk_gated_delta_rule = ... or torch_chunk_gated_delta_rule``); from 5.15 the forward calls
# the module-level functions. A bound kernel is found by identity (an instance attribute that is the
# function) and routed, while exporting, through the same op as the module-level one.
@contextlib.contextmanager
def kernels_bound(model: torch.nn.Module, routes: dict):
    """For the block, each instance attribute of ``model``'s modules that is a key of ``routes`` (a
    kernel function) is its value (the op it runs through); the attributes are put back after."""
    by_identity = {id(kernel): op for kernel, op in routes.items()}
    bound = [(module, name, value) for module in model.modules() for name, value in list(vars(module).items())
             if id(value) in by_identity]
    for module, name, value in bound:
        vars(module)[name] = by_identity[id(value)]
    try:
        yield
    finally:
        for module, name, value in bound:
            vars(module)[name] = value
