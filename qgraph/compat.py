"""The private torch / transformers internals qgraph relies on, each with its reason.

Every use of a private attribute lives here, so a torch or transformers upgrade breaks in one
place. ``pyproject.toml`` pins torch 2.13 and transformers 5.24; ``check_versions`` says so by name
when another version is installed.
"""
from __future__ import annotations

import contextlib
from importlib import metadata

import torch
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
