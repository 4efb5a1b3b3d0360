"""Compiled captures: an instrumented program run under ``torch.compile``, one block of each kind at a time.

``qgraph.instrument(model, values, compile=True)`` or ``ig.compile()`` compiles each program (the
image-text and the text-only one) by regions, as torch's regional compilation does for a model's
repeated modules: the program is cut at block boundaries (``qgraph.regions``: what precedes the blocks,
each block, what follows them), the regions that compute alike (blocks of one kind that tap and edit the
same values) share one ``GraphModule``, and each such group is one ``torch.compile(fullgraph=True)``,
called with each of its regions' tensors (parameters are inputs like activations). So the first call
compiles one block of each kind, whatever the depth: 4 graphs for a Qwen3.5 program (what precedes the
blocks, a DeltaNet block, an attention block, the final norm and head), where one graph of the whole
program grew with every block (``benchmarks/bench_compile.py``: the figures by depth).

* **Dynamic batch and sequence.** The regions' inputs whose exported shapes are symbolic (the batch and
  sequence dims of the activations, ``input_ids`` and ``attention_mask``; the patch and image dims of
  the image inputs) are marked dynamic on every call, so one compiled graph per group serves every
  prompt length, under ``no_grad`` and under grad mode alike (``compat.inductor_symbolic_strides_fix``
  keeps inductor from fixing the length where it lowers the conv's backward); the parameters stay static,
  which keeps the kernels specialised on the model's sizes. As everywhere in ``torch.compile``, a dim of
  size 1 is specialised on first sight, so a batch of one (or a one-token prompt) after larger ones
  compiles once more, and then never again.
* **Custom ops** (the delta-rule kernels, the packed vision attention) are single opaque nodes with
  fake kernels: the compiler calls them as they are.
* **Edit slots and taps.** A region returns the values asked of it beside what later regions read. A
  declared slot with no edit is traced as the identity; edits fixed at ``instrument`` time are traced
  into the graph (a block with a slot is a group of its own: a slot is its own module). A call that
  gives per-call edits (``ig(ids, edits={...})``) runs the eager program instead, so an edit (a Python
  function or a tensor that changes call to call) never triggers a recompile.
* The first call compiles (tens of seconds on CPU with a cold inductor cache, about the same for 4
  blocks as for 24; seconds when inductor's on-disk cache has the graphs); later calls reuse it. Values
  equal the eager program's to float rounding (≤ 1e-5). A call pays one compiled call per region (a
  dynamo guard check and inductor's wrapper, some tens of microseconds each), and no fusion crosses a
  block boundary.

``compile=`` and ``ig.compile(**options)`` take ``torch.compile`` options (``backend=``, ``mode=``,
...), given to each group's compile; ``fullgraph=True`` is the default.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .compat import inductor_symbolic_strides_fix, mark_dynamic
from .errors import InvalidType
from .regions import regions_of
from .runners import Compiled


@dataclass
class Step:
    """One region of a call: the compiled module of its group, the positions (in the call's list of tensors:
    the program's inputs, then each region's outputs) it reads, its inputs' dynamic dims, whether it returns
    one tensor bare, and the positions no later region nor the program's outputs read once it has run."""

    compiled: Callable
    reads: list[int]
    dynamic: list[tuple[int, list[int]]]
    bare: bool
    drop: list[int] = field(default_factory=list)


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
        slot: dict[tuple[int, int], int] = {}  # (region, output) -> its position in a call's list of tensors

        def position(source: tuple) -> int:
            return source[1] if source[0] == "input" else slot[source[1], source[2] or 0]

        self.steps: list[Step] = []
        for index, stage in enumerate(plan.modules):
            reads = [position(source) for source in plan.inputs[index]]
            for output in range(len(plan.readers[index])):
                slot[index, output] = count + len(slot)
            bare = not isinstance(stage.graph.output_node().args[0], (tuple, list))
            self.steps.append(Step(compiled[self.regions.group[index]], reads, _dynamic_dims(stage), bare))
        self.outputs = [position(source) for source in plan.outputs]
        kept = set(self.outputs)
        for (index, output), at in slot.items():  # a region's output is dropped after its last reader
            if at not in kept:
                self.steps[max(plan.readers[index][output], default=index)].drop.append(at)

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
        for step in self.steps:
            inputs = [tensors[at] for at in step.reads]
            for at, dims in step.dynamic:
                mark_dynamic(inputs[at], dims)
            produced = step.compiled(*inputs)
            if step.bare:
                tensors.append(produced)
            else:
                tensors.extend(produced)
            for at in step.drop:
                tensors[at] = None
        return tuple(tensors[at] for at in self.outputs)


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
