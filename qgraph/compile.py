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
from .regions import regions_of
from .runners import Compiled


class CompiledProgram:
    """A program's regions (``qgraph.regions``), each group of alike regions one ``torch.compile``d module,
    run in order on the program's inputs: called like the program's GraphModule, returning its outputs."""

    def __init__(self, module: torch.fx.GraphModule, block_lists=(), model_paths=frozenset(), **options):
        inductor_symbolic_strides_fix()
        self.options = {"fullgraph": True, **options}
        self.regions = regions_of(module, block_lists, model_paths)
        # each group's forward (a bound method: fewer Python layers per call than the module's __call__)
        compiled = [torch.compile(group.forward, **self.options) for group in self.regions.modules]
        plan = self.regions.plan
        count = len(module.graph.find_nodes(op="placeholder"))
        slot: dict[tuple[int, int], int] = {}  # (region, output) -> its index in a call's list of tensors
        # per region: (compiled module, what it reads, its dynamic dims, bare, what to drop after)
        self.steps: list[list] = []
        for index, stage in enumerate(plan.modules):
            reads = [source[1] if source[0] == "input" else slot[source[1], source[2] or 0]
                     for source in plan.inputs[index]]
            for output in range(len(plan.readers[index])):
                slot[index, output] = count + len(slot)
            bare = not isinstance(stage.graph.output_node().args[0], (tuple, list))
            self.steps.append([compiled[self.regions.group[index]], reads, _dynamic_dims(stage), bare, []])
        self.outputs = [source[1] if source[0] == "input" else slot[source[1], source[2] or 0]
                        for source in plan.outputs]
        kept = set(self.outputs)
        for (index, output), position in slot.items():  # a region's output is dropped after its last reader
            if position not in kept:
                self.steps[max(plan.readers[index][output], default=index)][4].append(position)

    def __call__(self, *args):
        if getattr(self, "_called", False):
            return self._run(args)
        from .progress import progress  # lazy: keeps tqdm out until this is used
        with progress("qgraph: compiling (first call)"):  # a line on stderr past 2 s
            result = self._run(args)
        self._called = True
        return result

    def _run(self, args) -> tuple:
        tensors = list(args)
        for compiled, reads, dynamic, bare, drop in self.steps:
            inputs = [tensors[position] for position in reads]
            for position, dims in dynamic:
                mark_dynamic(inputs[position], dims)
            produced = compiled(*inputs)
            if bare:
                tensors.append(produced)
            else:
                tensors.extend(produced)
            for position in drop:
                tensors[position] = None
        return tuple(tensors[position] for position in self.outputs)


def _dynamic_dims(module: torch.fx.GraphModule) -> list[tuple[int, list[int]]]:
    """Which dims of which inputs of ``module`` are dynamic: those the export left symbolic (the batch and
    sequence of the activations; the parameters' are static)."""
    dynamic = []
    for index, node in enumerate(module.graph.find_nodes(op="placeholder")):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            dims = [dim for dim, size in enumerate(value.shape) if not isinstance(size, int)]
            if dims:
                dynamic.append((index, dims))
    return dynamic


def compile_program(program, **options) -> CompiledProgram:
    """Compile a built ``qgraph.program.Program``: it runs by the ``Compiled`` runner from now on (the
    compiled regions, but for calls with per-call edits)."""
    lists = [listed.path for listed in program.family.repeated_blocks]
    paths = {path for path, _ in program.model.named_modules()}
    compiled = CompiledProgram(program.module, lists, paths, **options)
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
