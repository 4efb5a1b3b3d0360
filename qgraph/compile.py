"""Compiled captures: an instrumented program run under ``torch.compile``.

``qgraph.instrument(model, values, compile=True)`` or ``ig.compile()`` wraps each program's
GraphModule (the image-text and the text-only one) in ``torch.compile(fullgraph=True)``:

* **Dynamic batch and sequence.** The program's inputs whose exported shapes are symbolic (the
  batch and sequence dims of ``input_ids`` and ``attention_mask``; the patch and image dims of the
  image inputs) are marked dynamic on every call, so one compiled graph serves every prompt length;
  the parameters stay static, which keeps compile time down and the kernels specialised on the
  model's sizes. As everywhere in ``torch.compile``, a dim of size 1 is specialised on first sight,
  so a batch of one and then a batch of two compile twice, and then never again.
* **Custom ops** (the delta-rule kernels, the packed vision attention) are single opaque nodes with
  fake kernels: the compiler calls them as they are.
* **Edit slots.** A declared slot with no edit is traced as the identity; edits fixed at
  ``instrument`` time are traced into the graph. A call that gives per-call edits
  (``ig(ids, edits={...})``) runs the eager program instead, so an edit (a Python function or a
  tensor that changes call to call) never triggers a recompile, and no compiled graph is invalidated.
* The first call compiles (about a minute on CPU for the 0.8B shape with a cold inductor cache;
  seconds when inductor's on-disk cache has the kernels); later calls reuse it. Values equal the
  eager program's to float rounding (≤ 1e-5).

``compile=`` and ``ig.compile(**options)`` take ``torch.compile`` options (``backend=``, ``mode=``,
...); ``fullgraph=True`` is the default.
"""
from __future__ import annotations

import torch

from .compat import inductor_symbolic_strides_fix, mark_dynamic
from .errors import InvalidType
from .runners import Compiled


class CompiledProgram:
    """A program's GraphModule under ``torch.compile``, called with the program's inputs."""

    def __init__(self, module: torch.fx.GraphModule, **options):
        inductor_symbolic_strides_fix()
        self.options = {"fullgraph": True, **options}
        self.compiled = torch.compile(module, **self.options)
        # which dims of which inputs are dynamic: those the export left symbolic
        self.dynamic = []
        for index, node in enumerate(module.graph.find_nodes(op="placeholder")):
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                dims = [dim for dim, size in enumerate(value.shape) if not isinstance(size, int)]
                if dims:
                    self.dynamic.append((index, dims))

    def __call__(self, *args):
        for index, dims in self.dynamic:
            for dim in dims:
                mark_dynamic(args[index], dim)
        if getattr(self, "_called", False):
            return self.compiled(*args)
        from .progress import progress  # lazy: keeps tqdm out until this is used
        with progress("qgraph: compiling (first call)"):  # a line on stderr past 2 s
            result = self.compiled(*args)
        self._called = True
        return result


def compile_program(program, **options) -> CompiledProgram:
    """Compile a built ``qgraph.program.Program``: it runs by the ``Compiled`` runner from now on (the
    compiled module, but for calls with per-call edits)."""
    compiled = CompiledProgram(program.module, **options)
    program.runs_on(Compiled(compiled))
    return compiled


def compile_options(compile) -> dict | None:
    """``instrument(compile=...)``: False/None for none, True for the defaults, a dict of options."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if isinstance(compile, dict):
        return dict(compile)
    raise InvalidType(f"compile= takes True, False or a dict of torch.compile options, not {compile!r}")
