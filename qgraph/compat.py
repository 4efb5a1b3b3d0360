"""The private torch / transformers internals qgraph relies on, each with its reason.

Every use of a private attribute lives here, so a torch or transformers upgrade breaks in one
place. ``pyproject.toml`` pins torch 2.13 and transformers 5.24; ``check_versions`` says so by name
when another version is installed.
"""
from __future__ import annotations

import contextlib
from importlib import metadata

import torch
from torch._C import DispatchKey
from torch.nn.modules import module as _module

SUPPORTED = {"torch": "2.13", "transformers": "5.24"}

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


def check_versions() -> None:
    """Raise ImportError naming the package if torch or transformers is not the version qgraph's
    private calls were written for."""
    for package, version in SUPPORTED.items():
        installed = metadata.version(package)
        if not installed.startswith(version + "."):
            raise ImportError(f"qgraph needs {package} {version}.x (it uses {package} internals listed in "
                              f"qgraph/compat.py); {installed} is installed: pip install '{package}=={version}.*'")


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
    views with symbolic strides (``64 * seq`` and ``64``); torch 2.13's inductor sorts those without
    its shape env and fails with "cannot determine truth value of Relational: 1 < s53". This does
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
