"""Stages across processes on torch's own engine, ``torch.distributed.pipelining``.

torch's ``PipelineStage`` chains stage i to stage i+1 with a tuple of tensors, while a ``split.Plan``
is a DAG: a stage reads outputs of any earlier stage and program inputs (the attention mask). So
each stage is wrapped (``StageModule``) to take and return the tensors crossing its boundaries
(``Chain``): what later stages read, passed through, and what it adds. The batched program inputs
(``input_ids``, ``attention_mask``) and each micro-batch's row numbers enter at stage 0, where
torch's schedule cuts them into micro-batches; the other program inputs (the model's parameters and
buffers) are read by each stage where it runs, so ``.grad`` lands on the model's own parameters. What
a stage computes for the caller (its values, the logits) is kept on the side per micro-batch, keyed
by its first row, and a value asked with ``{"grad": True}`` keeps its gradient there (a tensor hook).

torch's stages allocate what they receive before they run, so they take its shapes: computed here
for each call from the graph's symbolic sizes and the call's batch and length, without running
anything. Where a size cannot be computed so (a data-dependent one), torch infers the shapes itself by
running the first micro-batch once more. A stage and its schedule are built per call (a few ms:
buffers, a vote between neighbours), so every call may have its own shape. A float that crosses a
boundary and depends on a parameter is declared to carry a gradient (``carries_grad``); a size
crosses as a 0-dim tensor. Torch's schedules run micro-batches of one size: an uneven cut (3 rows
into 2) runs as one schedule step per size, and a "1f1b" step with fewer micro-batches than stages
runs as "gpipe" (the same sums, in another order).

Tied parameters (``lm_head`` reading ``embed_tokens``' weight) are read by stages on two ranks: each
rank's backward gives its part of the gradient, and the parts are summed between those ranks after
the schedule, so every rank's ``.grad`` is the whole gradient, as in one process.

A failure on one rank ends every rank with its error (``world.vote``, at the start and the end of each
call). A stage's forward or the loss that raises keeps its error and gives torch's schedule what the
other ranks wait for: zeros of the shapes they expect (the row numbers -1, which tell the stages after
it to do the same), a zero loss on the logits (its backward sends zeros), so every rank comes to the
vote at the end of the call at once. A failure elsewhere (torch's schedule, a backward) leaves the
ranks waiting on its messages until the timeout of the group they cross (``world.pipe``) runs out.
"""
from __future__ import annotations

import torch

from ..compat import pipeline_stage, pipelining_refusal, size_expression
from ..errors import InvalidState, NotSupported
from ..runners import loss_value
from .split import Plan, pick
from .world import pipe, vote

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
ROWS = ("rows",)  # each micro-batch's row numbers: its key among the micro-batches


def schedule_class(name: str):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}[name]


def outputs_of(module) -> tuple[list, bool]:
    """A stage module's output nodes, and whether it returns its one output bare."""
    outputs = module.graph.output_node().args[0]
    bare = not isinstance(outputs, (tuple, list))
    return ([outputs] if bare else list(outputs)), bare


class Chain:
    """What crosses each boundary when a plan's stages run as a chain. ``root``: what enters stage 0
    (the row numbers, the batched program inputs any stage reads); ``carried[b]``: what crosses from
    stage b to b + 1 (items ``ROWS``, ``("input", i)``, ``("stage", s, k)`` as the plan names them)."""

    def __init__(self, plan: Plan, batched: set[int]):
        last: dict[tuple, int] = {}  # item -> the last stage reading it
        for stage, inputs in enumerate(plan.inputs):
            for kind, *where in inputs:
                if kind == "stage" or where[0] in batched:
                    item = (kind, *where)
                    last[item] = max(last.get(item, -1), stage)
        self.root = [ROWS] + sorted(item for item in last if item[0] == "input")
        produced = [("stage", s, None if bare else k) for s, module in enumerate(plan.modules)
                    for k in range(len(outputs_of(module)[0])) for bare in [outputs_of(module)[1]]]
        self.carried = [[ROWS] + [item for item in self.root[1:] + [p for p in produced if p[1] <= b]
                                  if last.get(item, -1) > b] for b in range(len(plan) - 1)]

    def into(self, stage: int) -> list:
        return self.root if stage == 0 else self.carried[stage - 1]


def carries_grad(plan: Plan, differentiable: set[int]) -> dict[tuple, bool]:
    """For each stage output, whether it may carry a gradient: a float computed from a program input in
    ``differentiable`` (the parameters) through floats. It over-approximates, which only costs zeros sent."""
    flags: dict[tuple, bool] = {}
    for stage, module in enumerate(plan.modules):
        grad = {}
        for node, (kind, *where) in zip(module.graph.find_nodes(op="placeholder"), plan.inputs[stage]):
            grad[node] = where[0] in differentiable if kind == "input" else flags[("stage",) + tuple(where)]
        for node in module.graph.nodes:
            if node.op not in ("placeholder", "output"):
                grad[node] = _floating(node) and any(grad.get(n, False) for n in node.all_input_nodes)
        outputs, bare = outputs_of(module)
        for k, node in enumerate(outputs):
            flags[("stage", stage, None if bare else k)] = grad.get(node, False)
    return flags


def _floating(node) -> bool:
    value = node.meta.get("val")
    if value is None:
        return True  # unknown (a slot's call): as if it were
    values = value if isinstance(value, (tuple, list)) else [value]
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in values)


class Engine:
    """Runs a plan's stages across processes with torch's schedules: rank r holds stages r, r + W, ...
    (W the world size; more than one per rank only for an interleaved schedule)."""

    def __init__(self, plan: Plan, rank: int, size: int, batched: set[int], input_values: list,
                 differentiable: set[int], parameters: set[int], schedule: str, logits: int | None,
                 timeout: float = 60.0):
        self.plan, self.rank, self.size, self.batched, self.schedule = plan, rank, size, batched, schedule
        self.timeout = timeout  # seconds: the longest wait on another rank's message
        self.local = list(range(rank, len(plan), size))
        self.chain = Chain(plan, batched)
        self.input_values, self.logits = input_values, logits
        self.grads = carries_grad(plan, differentiable)
        self.values = {("stage", s, None if bare else k): node.meta.get("val") for s, module in enumerate(plan.modules)
                       for outputs, bare in [outputs_of(module)] for k, node in enumerate(outputs)}
        readers: dict[int, set[int]] = {}
        for stage, inputs in enumerate(plan.inputs):
            for kind, *where in inputs:
                if kind == "input" and where[0] in parameters:
                    readers.setdefault(where[0], set()).add(stage % size)
        self.shared = {i: sorted(ranks) for i, ranks in sorted(readers.items()) if len(ranks) > 1}
        self.scalars = {item for item, value in self.values.items() if not isinstance(value, torch.Tensor)}

    def __call__(self, args: list, microbatches: int, loss=None,
                 watched=frozenset()) -> tuple[list, torch.Tensor | None]:
        """Run this rank's stages on ``args`` (program arguments), the batch cut as ``tensor_split`` cuts
        it into ``microbatches``: (the program outputs its stages own, None for others'; the summed loss on
        the rank of the last stage, else None). Torch's schedules run micro-batches of one size, so an
        uneven cut (3 rows into 2) runs as one schedule step per size."""
        import torch.distributed as dist
        refusal = pipelining_refusal(backward=True) if loss is not None else None
        if refusal is not None:  # the same torch on every rank: each raises it here, before any message
            raise NotSupported(f"loss= with stages across processes cannot run here: {refusal}; call without "
                               f"loss=, or upgrade torch")
        vote(None, self.timeout, start=True)  # every rank is here (one that failed before its stage ends them all)
        group = pipe(self.timeout)
        batch = args[next(iter(self.batched))].shape[0] if self.batched else 1
        sizes = [len(part) for part in torch.arange(batch).tensor_split(min(microbatches, batch))]
        starts = [sum(sizes[:m]) for m in range(len(sizes))]
        run = _Run(self, args, watched, loss is not None, starts)
        before = {i: _grad_of(args[i]) for i in self.shared if self.rank in self.shared[i]} if loss is not None else {}
        losses: list = []
        try:
            for size in sorted(set(sizes), reverse=True):  # the larger micro-batches come first
                count = sizes.count(size)
                first = starts[sizes.index(size)]
                self._step(run, group, args, slice(first, first + size * count), count, loss, losses)
        except Exception as error:  # noqa: BLE001 - every rank raises it (or names it) after the vote
            run.fail(error)
        vote(run.failure, self.timeout)
        if loss is not None:
            self._sum_shared(args, before, dist, group)
        value = torch.stack([piece.detach() for piece in losses]).sum() if losses else None
        return run.joined(), value

    def _step(self, run: _Run, group, args: list, rows: slice, count: int, loss, losses: list) -> None:
        """One schedule step over the batch's ``rows`` as ``count`` equal micro-batches."""
        device = stage_device()
        root = [torch.arange(rows.start, rows.stop, device=device)] + \
            [args[item[1]][rows].to(device) for item in self.chain.root[1:]]
        metas = self._metas(args, (rows.stop - rows.start) // count, backward=loss is not None)
        stages = [pipeline_stage(StageModule(run, s, None if metas is None else metas[s][1]), s, len(self.plan),
                                device, group=group, input_args=None if metas is None else metas[s][0],
                                output_args=None if metas is None else metas[s][1]) for s in self.local]
        name = "gpipe" if self.schedule == "1f1b" and count < len(self.plan) else self.schedule  # same sums, in turn
        scheduled = stages if name.startswith("interleaved") else stages[0]
        if loss is None:
            with torch.no_grad():
                schedule_class(name)(scheduled, count, scale_grads=False).step(*root, return_outputs=False)
        else:
            schedule = schedule_class(name)(scheduled, count, loss_fn=lambda logits, _: run.loss(loss, logits),
                                            scale_grads=False)
            step_losses: list = []
            schedule.step(*root, target=torch.zeros(rows.stop - rows.start, device=device), losses=step_losses,
                          return_outputs=False)
            losses += step_losses

    def _metas(self, args: list, rows: int, backward: bool):
        """Per local stage, (what it receives, what it sends) as meta tensors of one micro-batch; None
        when a size cannot be computed from the graph (torch then infers them)."""
        bindings = {}
        for i, value in enumerate(self.input_values):
            if isinstance(value, torch.Tensor) and isinstance(args[i], torch.Tensor):
                for d, size in enumerate(value.shape):
                    expression = size_expression(size)
                    if getattr(expression, "is_Symbol", False):
                        bindings[expression] = rows if i in self.batched and d == 0 else args[i].shape[d]

        def meta(item):
            if item == ROWS:
                return torch.empty(rows, dtype=torch.int64, device="meta")
            if item[0] == "input":
                return torch.empty((rows, *args[item[1]].shape[1:]), dtype=args[item[1]].dtype, device="meta")
            value = self.values[item]
            if not isinstance(value, torch.Tensor):  # a size: crosses as a 0-dim tensor
                return torch.empty((), dtype=_scalar_dtype(value), device="meta")
            shape = [_evaluate(size_expression(size), bindings) for size in value.shape]
            empty = torch.empty(shape, dtype=value.dtype, device="meta")
            return empty.requires_grad_(backward and self.grads[item] and empty.is_floating_point())

        last = len(self.plan) - 1
        logits = None if self.logits is None else self.plan.outputs[self.logits]
        if backward and logits is None and last in self.local:
            return None  # the loss has no logits to read: the last stage's run raises InvalidState naming it
        try:
            return {s: (tuple(meta(item) for item in self.chain.into(s)),
                        tuple(meta(item) for item in self.chain.carried[s]) if s < last else
                        ((meta(logits),) if backward else ())) for s in self.local}
        except TypeError:  # a size the call's inputs do not determine
            return None

    def _sum_shared(self, args: list, before: dict, dist, group) -> None:
        """Sum the parts of each tied parameter's gradient between the ranks whose stages read it (in
        place in ``.grad``: one all-reduce when every rank reads it)."""
        for i, ranks in self.shared.items():
            if self.rank not in ranks:
                continue
            parameter = args[i]
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            part = parameter.grad if before[i] is None else parameter.grad.sub_(before[i])  # this call's part
            if len(ranks) == self.size:
                dist.all_reduce(part, group=group)
            elif self.rank == ranks[0]:
                received = torch.empty_like(part)
                for other in ranks[1:]:
                    dist.recv(received, other, group=group)
                    part.add_(received)
                for other in ranks[1:]:
                    dist.send(part, other, group=group)
            else:
                dist.send(part, ranks[0], group=group)
                dist.recv(part, ranks[0], group=group)
            if before[i] is not None:
                part.add_(before[i])


def _scalar_dtype(value) -> torch.dtype:
    if isinstance(value, (bool, torch.SymBool)):
        return torch.bool
    return torch.int64 if isinstance(value, (int, torch.SymInt)) else torch.float64


def _grad_of(tensor):
    return tensor.grad.detach().clone() if isinstance(tensor, torch.Tensor) and tensor.grad is not None else None


def _evaluate(expression, bindings: dict) -> int:
    value = expression.xreplace(bindings) if hasattr(expression, "xreplace") else expression
    return int(value)  # TypeError when a symbol is left


def stage_device() -> torch.device:
    """Where this rank's stage receives: its GPU under nccl, else the CPU."""
    import torch.distributed as dist
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


class _Run:
    """One call: the program arguments, and what each local stage kept per micro-batch."""

    def __init__(self, engine: Engine, args: list, watched, backward: bool, rows):
        self.engine, self.args, self.watched, self.backward = engine, args, watched, backward
        self.rows = set(rows)  # each micro-batch's first row (torch inferring shapes may run others: dropped)
        self.kept: dict[int, dict[int, dict]] = {s: {} for s in engine.local}  # stage -> first row -> {position: value}
        self.gradients: dict[int, dict[int, torch.Tensor]] = {}  # position -> first row -> its gradient
        self.owned = {s: [(p, where[1]) for p, (kind, *where) in enumerate(engine.plan.outputs)
                          if kind == "stage" and where[0] == s] for s in engine.local}
        self.failure: Exception | None = None  # this rank's first failure: every rank raises it after the vote
        self.poisoned = False  # whether a stage here got the zeros of a failed one (its row numbers -1)

    def fail(self, error: Exception) -> None:
        self.failure = self.failure or error

    def loss(self, loss, logits: torch.Tensor) -> torch.Tensor:
        """``loss(logits)`` of one micro-batch; after a failure here, a zero loss on the logits' graph: its
        backward still sends the stages before what they wait for (zeros)."""
        if self.failure is None and not self.poisoned:
            try:
                return loss_value(loss, logits)
            except Exception as error:  # noqa: BLE001 - raised on every rank after the vote
                self.fail(error)
        return logits.sum() * 0

    def keep(self, stage: int, row: int, produced) -> None:
        kept = self.kept[stage][row] = {}
        for position, index in self.owned[stage]:
            tensor = kept[position] = pick(produced, index)
            if position in self.watched and isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad, p=position: self.gradients.setdefault(p, {}).__setitem__(row, grad))

    def joined(self) -> list:
        """Every program output this rank owns, its micro-batches joined along the batch (None for others')."""
        outputs = [self.args[where[0]] if kind == "input" else None for kind, *where in self.engine.plan.outputs]
        for stage, kept in self.kept.items():
            rows = sorted(row for row in kept if row in self.rows)
            for position, _ in self.owned[stage]:
                pieces = [kept[row][position] for row in rows]
                output = _cat([p.detach() if isinstance(p, torch.Tensor) else p for p in pieces])
                if position in self.watched:
                    grads = self.gradients.get(position, {})
                    output = output.requires_grad_(True)
                    if len(grads) == len(rows):
                        output.grad = _cat([grads[row] for row in rows])
                outputs[position] = output
        return outputs


def _cat(pieces: list):
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class StageModule(torch.nn.Module):
    """Stage ``index`` of a plan as torch's engine runs it: takes the tensors crossing into it
    (``Chain.into``), returns those crossing out (on the last stage, the logits for the loss). It holds
    the model's parameters its stage reads, so ``.grad`` lands on them."""

    def __init__(self, run: _Run, index: int, sends: tuple | None = None):
        super().__init__()
        self.run, self.index, self.module = run, index, run.engine.plan.modules[index]
        self.sends = sends  # meta tensors of what it returns for one micro-batch (None: unknown)
        for kind, *where in run.engine.plan.inputs[index]:
            if kind == "input" and isinstance(run.args[where[0]], torch.nn.Parameter):
                self.register_parameter(f"input{where[0]}", run.args[where[0]])

    def forward(self, *carried):
        run = self.run
        if int(carried[0][0]) < 0:  # the row numbers: -1 after a failed stage
            run.poisoned = True
        elif run.failure is None:
            try:
                return self._forward(carried)
            except Exception as error:  # noqa: BLE001 - raised on every rank after the vote
                run.fail(error)
        if self.sends is None:  # the shapes to send are unknown: the others wait until the timeout
            raise run.failure or InvalidState("a stage before this one failed, and this one cannot send on")
        return self._zeros()

    def _zeros(self):
        """What this stage sends after a failure: zeros of the shapes expected (its row numbers -1)."""
        device = stage_device()
        sent = [torch.zeros(meta.shape, dtype=meta.dtype, device=device).requires_grad_(meta.requires_grad)
                for meta in self.sends]
        if self.index == len(self.run.engine.plan) - 1:
            return sent[0] if sent else ()
        return (torch.full_like(sent[0], -1), *sent[1:])

    def _forward(self, carried):
        engine, run, stage = self.run.engine, self.run, self.index
        plan = engine.plan
        env = {item: value.item() if item in engine.scalars else value
               for item, value in zip(engine.chain.into(stage), carried)}
        inputs = [env[(kind,) + tuple(where)] if kind == "stage" or where[0] in engine.batched else run.args[where[0]]
                  for kind, *where in plan.inputs[stage]]
        produced = self.module(*inputs)
        outputs, bare = outputs_of(self.module)
        for k in range(len(outputs)):
            env[("stage", stage, None if bare else k)] = pick(produced, None if bare else k)
        run.keep(stage, int(env[ROWS][0]), produced)
        if stage == len(plan) - 1:
            if not run.backward:
                return ()
            if engine.logits is None or plan.owner(engine.logits) != stage:
                raise InvalidState("loss= reads the logits, which this program does not compute on its last stage")
            return pick(produced, plan.outputs[engine.logits][2])
        return tuple(_sendable(env[item]) for item in engine.chain.carried[stage])


def _sendable(value) -> torch.Tensor:
    """What crosses to the next stage: a tensor made contiguous, a size as a 0-dim tensor."""
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    return torch.tensor(value, dtype=_scalar_dtype(value), device=stage_device())
