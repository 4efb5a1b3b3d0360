"""One rank of the two-process stage test (tests/test_stages.py runs it under torchrun):
instrument the tiny checkpoint with stages=2, call it plain, with an edit on stage 2, with
micro-batches gathered to rank 0, and from a model built on meta with this rank's weights read from the
checkpoint; save what this rank got."""
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
torch.save(results, f"{out}/rank{torch.distributed.get_rank()}.pt")
