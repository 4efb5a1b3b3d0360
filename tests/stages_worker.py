"""One rank of the two-process stage test (tests/test_stages.py runs it under torchrun):
instrument the tiny checkpoint with stages=2, call it plain, with an edit on stage 2, with
micro-batches gathered to rank 0, and from a model built on meta with this rank's weights read from the
checkpoint; then forward and backward (``loss=``) on torch's schedules through a tied copy of the model
(lm_head reads embed_tokens' weight); save what this rank got."""
import sys

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
results = {}
for name, run in {"plain": lambda: staged(ids, mask), "edited": lambda: staged(ids, mask, edits=edit),
                  "gathered": lambda: qgraph.instrument(model, values=VALUES, stages=qgraph.Stages([2], microbatches=2,
                                                                                                    gather=True))(ids, mask)}.items():
    got = run()
    results[name] = (got.logits, got.values)
# a model built on meta: exported without weights, each rank reads only its stage's from the checkpoint
with torch.device("meta"):
    meta = AutoModelForCausalLM.from_config(model.config).eval()
low = qgraph.instrument(meta, values=VALUES, stages=2)
results["read"] = low.load_weights(checkpoint)
got = low(ids, mask)
results["meta"] = (got.logits, got.values)
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
torch.save(results, f"{out}/rank{torch.distributed.get_rank()}.pt")
