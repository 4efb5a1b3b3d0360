"""torch.distributed.pipelining's internals that qgraph's stages across processes rely on, and the
differences between the releases, each with its reason (see ``qgraph.compat``).

qgraph's stages (``qgraph.distributed.engine``) run on torch's ``PipelineStage`` and schedules, and ask two
things of them that not every release gives:

- **A call of fewer micro-batches than stages** (the default: one micro-batch through two stages). torch
  2.10's schedules refuse it in their constructor ("Number of microbatches (1) must be greater than or
  equal to the number of stages (2)"); 2.12's run it. Told by constructing a schedule of one micro-batch
  over a stand-in of two stages: a ``ValueError`` there is that refusal (anything else the stand-in lacks
  is not). Where it is refused, stages across processes raise ``NotSupported`` (``pipelining_refusal``).
- **A backward in which a received input gets no gradient.** Each stage receives the micro-batch's row
  numbers and the attention mask (integers) beside the hidden states, and qgraph declares every float
  computed from a parameter as carrying a gradient (it over-approximates). torch 2.13 sends the stage
  before only the gradients it waits for, zeros where the backward reached none; torch 2.12 wants a
  gradient for every received input and refuses the backward ("PipeliningMetadataError: [1] for chunk 0
  has gradients None and is expecting to send gradients to stage 0"). Told by the stage method 2.13 added
  for those zeros (``_get_grad_send_meta``); without it, where the stage's receive records carry their
  metadata (``_RecvInfo``'s ``is_root_arg`` and ``tensor_meta``, as in 2.12), ``pipeline_stage`` makes a
  stage that does what 2.13 does: it sends a gradient only for an input declared to carry one, zeros where
  the backward gave none (the same sums). A release with neither cannot run ``loss=`` across processes.
"""
from __future__ import annotations

import functools
import inspect
import types

import torch


@functools.cache
def _schedules_take_fewer_microbatches_than_stages() -> bool:
    from torch.distributed.pipelining import ScheduleGPipe
    try:
        stage = types.SimpleNamespace(num_stages=2)  # a stand-in: the check reads only num_stages
        ScheduleGPipe(stage, 1)  # type: ignore[arg-type]  # (a stand-in, not a _PipelineStageBase)
    except ValueError:
        return False
    except Exception:  # noqa: BLE001 (the stand-in lacks what a newer constructor reads: not that refusal)
        return True
    return True


@functools.cache
def _stages_send_only_declared_gradients() -> bool:
    from torch.distributed.pipelining.stage import _PipelineStageBase
    return hasattr(_PipelineStageBase, "_get_grad_send_meta")


@functools.cache
def _receive_records_carry_metadata() -> bool:
    from torch.distributed.pipelining.stage import _RecvInfo
    return {"is_root_arg", "tensor_meta"} <= set(inspect.signature(_RecvInfo).parameters)


def pipelining_refusal(backward: bool = False) -> str | None:
    """Why this torch's pipelining cannot run qgraph's stages across processes (with a backward, if
    ``backward``), as the end of a sentence; None where it can (see above)."""
    if not _schedules_take_fewer_microbatches_than_stages():
        return (f"this torch ({torch.__version__})'s pipeline schedules refuse fewer micro-batches than stages "
                f"(torch.distributed.pipelining; torch 2.12 runs them)")
    if backward and not (_stages_send_only_declared_gradients() or _receive_records_carry_metadata()):
        return (f"this torch ({torch.__version__})'s pipeline stages want a gradient for every input they "
                f"receive, which the row numbers and the mask do not have (torch.distributed.pipelining)")
    return None


def pipeline_stage(*args, **kwargs):
    """``torch.distributed.pipelining.PipelineStage(*args, **kwargs)``, or where its backward wants a
    gradient for every received input (torch 2.12), one that sends only the declared ones (see above)."""
    from torch.distributed.pipelining import PipelineStage
    if _stages_send_only_declared_gradients() or not _receive_records_carry_metadata():
        return PipelineStage(*args, **kwargs)
    return _declared_gradients_stage()(*args, **kwargs)


@functools.cache
def _declared_gradients_stage():
    from torch.distributed.pipelining import PipelineStage

    class DeclaredGradientsStage(PipelineStage):
        """torch 2.13's gradient sends on torch 2.12: to the stage before, a gradient for each received input
        whose metadata says it carries one (what that stage waits for), zeros where the backward reached
        none; nothing for the others (integers: the row numbers, the mask)."""

        def get_bwd_send_ops(self, bwd_chunk_id: int):
            if self.has_backward and not self.is_first:
                received = self.args_recv_info[0]
                if self.grad_send_info is None:
                    self.grad_send_info = [None if info.is_root_arg or info.tensor_meta is None
                                           or not info.tensor_meta.requires_grad else info.source for info in received]
                grads = self.bwd_cache.get(bwd_chunk_id)
                if grads is not None:
                    self.bwd_cache[bwd_chunk_id] = tuple(
                        # torch types _RecvInfo.buffer Optional; a received argument's is set
                        torch.zeros_like(info.buffer, requires_grad=False)  # type: ignore[arg-type]
                        if grad is None and to is not None else grad
                        for grad, to, info in zip(grads, self.grad_send_info, received))
            return super().get_bwd_send_ops(bwd_chunk_id)

    return DeclaredGradientsStage
