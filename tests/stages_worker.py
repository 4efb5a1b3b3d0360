"""One rank of the two-process stage test (tests/test_stages.py runs it under torchrun):
instrument the tiny checkpoint with stages=2, call it plain, with an edit on stage 2, with
micro-batches gathered to rank 0, and from a model built on meta with this rank's weights read from the
checkpoint; calls that fail on one rank (its weights, the loss, an edit, a backward), each noted as the
error this rank raised and how long it took; then forward and backward (``loss=``) on torch's schedules
through a tied copy of the model (lm_head reads embed_tokens' weight), after those failures; save what
this rank got."""
import faulthandler
import sys
import time

import torch
from transformers import AutoModelForCausalLM

import qgraph

checkpoint, inputs, out = sys.argv[1:4]
VALUES = ["layers.*.layer_output", "layers.0.linear_attn.states", "layers.3.self_attn.attention_gate"]
model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
given = torch.load(inputs)
ids, mask, edit = given["ids"], given["mask"], {"layers.2.layer_output": qgraph.Zero(positions=[-1])}
staged = qgraph.instrument(model, values=VALUES, edits=["layers.2.layer_output"], stages=2)
assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 2
results, failures = {}, {}
rank = torch.distributed.get_rank()


def attempt(name, call):
    """Run a call that fails on one rank: note (the error's type, its message, its cause's type, seconds)."""
    start = time.perf_counter()
    try:
        call()
    except Exception as error:  # noqa: BLE001 - what the test asserts on
        cause = type(error.__cause__).__name__ if error.__cause__ is not None else None
        failures[name] = (type(error).__name__, str(error), cause, time.perf_counter() - start)
    else:
        failures[name] = (None, "", None, time.perf_counter() - start)


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ArithmeticError("the backward fails on rank 1")


def fails(_):
    raise KeyError("the edit fails on rank 1")


def failing_loss(logits):
    raise ValueError("the loss fails on the last stage")


for name, run in {"plain": lambda: staged(ids, mask), "edited": lambda: staged(ids, mask, edits=edit),
                  "gathered": lambda: qgraph.instrument(model, values=VALUES, stages=qgraph.Stages([2], microbatches=2,
                                                                                                    gather=True))(ids, mask)}.items():
    got = run()
    results[name] = (got.logits, got.values)
# a model built on meta: exported without weights, each rank reads only its stage's from the checkpoint
with torch.device("meta"):
    meta = AutoModelForCausalLM.from_config(model.config).eval()
low = qgraph.instrument(meta, values=VALUES, stages=2)
faulthandler.dump_traceback_later(120, exit=True)  # a rank left waiting by a failure fails the test, not hangs it
if rank == 0:  # rank 1 calls without its weights: it fails before its stage runs
    low.load_weights(checkpoint)
attempt("weights", lambda: low(ids, mask))
results["read"] = low.load_weights(checkpoint)
got = low(ids, mask)
results["meta"] = (got.logits, got.values)
# a failure on one rank ends both (the loss, an edit on stage 2, a backward on stage 2: rank 1), the groups renewed
attempt("loss", lambda: staged(ids, mask, loss=failing_loss))
attempt("edit", lambda: staged(ids, mask, edits={"layers.2.layer_output": fails}))
bounded = qgraph.instrument(model, values=VALUES, edits=["layers.2.layer_output"], stages=qgraph.Stages(2, timeout=2))
attempt("backward", lambda: bounded(ids, mask, loss=lambda logits: logits[:, -1].sum(),
                                    edits={"layers.2.layer_output": FailingBackward.apply}))
faulthandler.cancel_dump_traceback_later()
results["failures"] = failures
# loss= on torch's engine: the parameters' .grad on this rank, the gradients of the values its stages hold, the loss
tied = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
tied.lm_head.weight = tied.model.embed_tokens.weight
GRADS = {"layers.*.layer_output": {}, "layers.1.layer_output": {"grad": True}, "layers.3.layer_input": {"grad": True}}
LOSS = lambda logits: logits[:, -1].logsumexp(-1).sum()  # noqa: E731 - summed over the batch, as in test_stages.py
for name, stages in {"gpipe": qgraph.Stages(2), "1f1b": qgraph.Stages(2, microbatches=2, schedule="1f1b"),
                     "interleaved": qgraph.Stages(4, microbatches=2, schedule="interleaved-1f1b", gather=True)}.items():
    tied.zero_grad(set_to_none=True)
    staged = qgraph.instrument(tied, values=GRADS, stages=stages)
    got = staged(ids[:2], mask[:2], loss=LOSS)
    results[name] = ({n: p.grad for n, p in tied.named_parameters() if p.grad is not None},
                     {n: got.grad(n) for n in got.watched}, got.loss, got.logits, got.values)
results["interleaved forward"] = staged(ids, mask).values  # forward-only on torch's engine, gathered to rank 0
torch.save(results, f"{out}/rank{rank}.pt")
