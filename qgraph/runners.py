"""How a built program runs: a runner object, chosen when the instrument builds the program.

A ``Program`` (``qgraph.program``) is built once; how it runs is its ``runner``, one of

- ``Eager``: the program's ``GraphModule``'s forward, each operator called at its C++ entry point
  (``qgraph.direct``; the default);
- ``Compiled``: the module under ``torch.compile`` (``qgraph.compile``), but a call with per-call
  edits, a watched gradient or a loss runs the eager module;
- ``Staged``: the program cut into stages (``qgraph.distributed``), all in this process or one a rank.

Each has one method, ``run(program, args, loss, watched, eager) -> (results, loss value)``, the call
of a program on its arguments, and says which of the program's inputs this process feeds
(``local_inputs``) and where its stages are (``placement``). The instruments choose the runner when
they build a program (``Program.runs_on``), as nnsight's backends are chosen; nothing else sets how a
program runs. Where an instrument itself runs (here, on a server, from a saved file) is its own class
behind one interface (``qgraph.interface.Instrument``).
"""
from __future__ import annotations

import torch

from . import direct
from .errors import InvalidArgument


def loss_value(loss, logits: torch.Tensor) -> torch.Tensor:
    """``loss(logits)``, checked to be a scalar tensor (what a backward starts from)."""
    value = loss(logits)
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise InvalidArgument(f"loss= maps the logits to a scalar tensor (e.g. lambda logits: logits[:, -1, 0].sum()); "
                              f"it returned {got}")
    return value


class Eager:
    """The program's module, called in this process (its forward as ``direct.forward`` runs it)."""

    name = "eager"
    placement = None  # every input on the model's devices

    def module(self, program, eager: bool):
        return direct.forward(program.module)

    def local_inputs(self, count: int) -> range:
        """The program inputs this process feeds: all of them."""
        return range(count)

    def abandon(self, error: BaseException) -> None:
        """A call failed before it ran (no other process waits on this one)."""

    def run(self, program, args: list, loss, watched: frozenset, eager: bool) -> tuple[list, torch.Tensor | None]:
        results = list(self.module(program, eager or bool(watched) or loss is not None)(*args))
        if loss is None:
            return results, None
        for position in watched:
            if results[position].requires_grad:
                results[position].retain_grad()
        value = loss_value(loss, results[0])
        value.backward()
        return results, value.detach()


class Compiled(Eager):
    """The program's module under ``torch.compile`` (``compiled``: a ``qgraph.compile.CompiledProgram``);
    a call that edits, watches a gradient or runs a backward runs the eager module."""

    name = "compiled"

    def __init__(self, compiled):
        self.compiled = compiled

    def module(self, program, eager: bool):
        return direct.forward(program.module) if eager else self.compiled

    @property
    def called(self) -> bool:
        """Whether the first call (the one that compiles) has run."""
        return getattr(self.compiled, "_called", False)


class Staged:
    """The program cut into stages (``pipeline``: a ``qgraph.distributed.pipeline.Pipeline``): this
    process's stages under torchrun, or all of them."""

    name = "staged"

    def __init__(self, pipeline):
        self.pipeline = pipeline

    @property
    def placement(self):
        return self.pipeline.placement

    @property
    def stages(self) -> int:
        return len(self.pipeline.plan)

    def local_inputs(self, count: int):
        return self.pipeline.local_inputs(count)

    def abandon(self, error: BaseException) -> None:
        """Under torchrun the other ranks' stages wait on this one's: they are told, and raise too."""
        self.pipeline.abandon(error)

    def run(self, program, args: list, loss, watched: frozenset, eager: bool) -> tuple[list, torch.Tensor | None]:
        results, value = self.pipeline(args, loss, watched)  # each stage runs eagerly
        return list(results), value


EAGER = Eager()
