"""What the pages say their blocks give (``CLAIMS``), checked by ``tests/test_readme.py`` on the page's own
namespace right after the claimed block ran. A check may compute its reference with conftest's helpers
(``hf_logits``, ``random_ids``); it reads the page's names from ``ns`` and adds none to it."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import qgraph
from conftest import hf_logits, random_ids


def reading_values(ns):
    # "out.logits  # as the model returns them"
    inputs = ns["tokenizer"](["The Eiffel Tower is in", "Hi"], return_tensors="pt", padding=True)
    torch.testing.assert_close(ns["out"].logits, hf_logits(ns["model"], **inputs), rtol=0, atol=1e-5)
    assert ns["out"]["layers.3.layer_output"] is ns["out"].values["layers.3.layer_output"]
    # "attention_scores and attention_probabilities are there under both loads"
    assert ns["model"].config._attn_implementation == "sdpa"
    table = qgraph.support(ns["model"])
    assert table["layers.3.self_attn.attention_scores"].available
    assert table["layers.3.self_attn.attention_probabilities"].available


def main_job(ns):
    # "out.logits: the model's own"; the zeroed last token moves the logits
    model, batch, out = ns["model"], ns["batch"], ns["out"]
    torch.testing.assert_close(out.logits, hf_logits(model, **batch), rtol=0, atol=1e-5)
    assert isinstance(out.plot("layers.0.linear_attn.effective_attention"), qgraph.Figure)
    assert not torch.allclose(ns["ablated"].logits, out.logits)


def getting_started(ns):
    # "the model's own logits"; the zeroed last token moves block 2's output there, and only there
    model, batch, out, ablated = ns["model"], ns["batch"], ns["out"], ns["ablated"]
    torch.testing.assert_close(out.logits, hf_logits(model, **batch), rtol=0, atol=1e-5)
    probs = out["layers.3.self_attn.attention_probabilities"]
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]), rtol=0, atol=1e-5)
    moved = (ablated["layers.2.layer_output"] != out["layers.2.layer_output"]).any(-1)
    assert moved[:, -1].all() and not moved[:, :-1].any()


def editing_values(ns):
    # the value at an edit point is captured as edited; a head's zero edit moves what follows
    ig, ids, v = ns["ig"], ns["ids"], ns["v"]
    plain = ig(input_ids=ids)
    torch.testing.assert_close(ns["out"]["layers.2.layer_output"], plain["layers.2.layer_output"] + v, rtol=0, atol=0)
    assert torch.equal(ns["out"]["layers.1.layer_output"], plain["layers.1.layer_output"])
    assert not torch.allclose(ns["out"].logits, plain.logits)


def gradients(ns):
    # "model parameters get .grad, as with the HF model"
    model = ns["model"]
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model(input_ids=ns["ids"]).logits[:, -1].logsumexp(-1).sum().backward()
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(expected) and len(expected) > 40
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def continued_prompt(ns):
    # the DeltaNet blocks give the same values for ids[:, t:] as one run over ids
    whole = ns["ig"](ns["ids"])
    for block in ns["blocks"]:
        for value in ("state_output", "conv_state_output"):
            torch.testing.assert_close(ns["second"][f"{block}.{value}"], whole[f"{block}.{value}"], rtol=0, atol=1e-5)


def states(ns):
    out = ns["ig"](random_ids(1, 6))
    every, chosen, some = (out[f"layers.{i}.linear_attn.{v}"] for i, v in enumerate(("states", "state", "states")))
    assert every.shape[:2] == (1, 6) and every.dtype == torch.float32
    assert chosen.shape[1] == 3
    assert some.dtype == torch.bfloat16 and some.shape[2] == 2


def delta_attention(ns):
    # "rebuilt equals attention_head_outputs to float32 precision"; "Zero at write_values = Zero at betas"
    b, out = ns["b"], ns["out"]
    torch.testing.assert_close(ns["rebuilt"], out[f"{b}.attention_head_outputs"], rtol=1e-5, atol=1e-7)
    by_beta = ns["ig"](ns["ids"], edits={f"{b}.betas": qgraph.Zero(positions=[3], heads=[1])})
    torch.testing.assert_close(ns["zeroed"].logits, by_beta.logits, rtol=0, atol=1e-6)
    assert not torch.allclose(ns["zeroed"].logits, out.logits)


def images(ns):
    # "a list: [heads, patches_j, patches_j] per image"; the logits are the model's
    patterns = ns["out"]["vision.layers.1.self_attn.attention_probabilities"]
    inputs = ns["processor"](text=ns["prompt"], images=[ns["image_a"], ns["image_b"]], return_tensors="pt")
    patches = (inputs["image_grid_thw"].prod(-1)).tolist()
    assert [p.shape[-1] for p in patterns] == patches
    for p in patterns:
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]), rtol=0, atol=1e-5)
    with torch.no_grad():
        expected = ns["model"](**inputs).logits
    torch.testing.assert_close(ns["out"].logits, expected, rtol=0, atol=1e-5)


def videos(ns):
    # "one [heads, h*w, h*w] per image, then per temporal patch"; the logits are the model's
    inputs, out = ns["inputs"], ns["out"]
    patterns = out["vision.layers.1.self_attn.attention_probabilities"]
    image, frames = inputs["image_grid_thw"][0], inputs["video_grid_thw"][0]
    assert [p.shape[-1] for p in patterns] == [int(image.prod())] + [int(frames[1] * frames[2])] * int(frames[0])
    with torch.no_grad():
        expected = ns["model"](**inputs).logits
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=1e-5)


def diagrams(ns):
    for name in ("block3.svg", "block0-ops.png", "model.svg"):
        assert Path(name).stat().st_size > 1000, name
    assert Path("block0-ops.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in Path("block3.svg").read_text()


def generation(ns):
    out, enc = ns["out"], ns["enc"]
    prompt = enc["input_ids"].shape[1]
    assert out.sequences.shape[1] > prompt and torch.equal(out.sequences[:, :prompt], enc["input_ids"])
    assert out.steps[0]["layers.3.layer_output"].shape[1] == prompt
    assert out.steps[5]["layers.3.layer_output"].shape[1] == 1


def capturing(ns):
    run, cap, model, tokenizer = ns["run"], ns["cap"], ns["model"], ns["tokenizer"]
    # "which document each token comes from": the texts' tokens, each ended by eos, in order
    stream = [token for text in ns["texts"] for token in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    mask = cap.values("attention_mask").bool()
    assert run.tokens == len(stream) and torch.equal(cap.values("input_ids")[mask], torch.tensor(stream))
    assert cap.values("doc_id")[mask].unique().tolist() == list(range(len(ns["texts"])))
    # row 0's [context, hidden_size]: the instrumented call's value, cast to bfloat16
    ig = qgraph.instrument(model, values=["layers.3.layer_output"], logits=False)
    rows = ig(input_ids=cap.values("input_ids")[:2], attention_mask=cap.values("attention_mask")[:2])
    assert torch.equal(cap[0]["layers.3.layer_output"], rows["layers.3.layer_output"][0].to(torch.bfloat16))


def mixtures_of_experts(ns):
    moe, out, ids = ns["moe"], ns["out"], ns["ids"]
    torch.testing.assert_close(out.logits, hf_logits(moe, ids), rtol=0, atol=1e-5)
    ablated = ns["ablated"]
    # "expert 3's contribution, gone": nothing rerouted, its weight zero, the experts' sum changed where it was routed
    assert torch.equal(ablated["layers.1.mlp.router_indices"], out["layers.1.mlp.router_indices"])
    routed = (out["layers.1.mlp.router_indices"] == 3).any(-1)
    assert routed.any() and (ablated["layers.1.mlp.expert_weights"][..., 3] == 0).all()
    changed = (ablated["layers.1.mlp.experts_output"] != out["layers.1.mlp.experts_output"]).any(-1)
    assert torch.equal(changed, routed)


def saes(ns):
    sae, out, model, ids = ns["sae"], ns["out"], ns["model"], ns["ids"]
    # "the model's own": the error term is added back
    torch.testing.assert_close(out.logits, hf_logits(model, ids), rtol=0, atol=0)
    x = out["layers.1.sae.error"] + out["layers.1.sae.reconstruction"]
    torch.testing.assert_close(out["layers.1.sae.features"], sae.encode(x), rtol=0, atol=1e-5)
    top = out["layers.1.sae.features"].topk(sae.k, dim=-1)
    assert torch.equal(out["layers.1.sae.indices"], top.indices.int())
    assert torch.equal(ns["activations"], top.values[..., :5]) and torch.equal(ns["features"], top.indices[..., :5])
    assert not torch.allclose(ns["steered"].logits, out.logits)
    # Zero(neurons=[4]) moves the stream by the decoded change (feature 4 is active here)
    assert (out["layers.1.sae.features"][..., 4] > 0).all()
    zeroed = out["layers.1.sae.features"].clone()
    zeroed[..., 4] = 0
    moved = sae.decode(zeroed) - sae.decode(out["layers.1.sae.features"])
    torch.testing.assert_close(ns["ablated"]["layers.1.sae.reconstruction"] - out["layers.1.sae.reconstruction"],
                               moved, rtol=0, atol=1e-5)


def saved_programs(ns):
    ig, out, ids = ns["ig"], ns["out"], ns["ids"]
    # "edits at its saved slots": the instrumented model's edited call, exactly
    expected = ig(ids, edits={"layers.1.layer_output": qgraph.Zero(positions=[-1])})
    assert torch.equal(out.logits, expected.logits) and not torch.equal(out.logits, ig(ids).logits)
    assert all(torch.equal(out[name], expected[name]) for name in expected.values)


def stages_cut(ns):
    # "cut at block boundaries": the unsplit program's values; "exported on meta": the checkpoint's weights
    ids = ns["ids"]
    plain, cut = qgraph.instrument(ns["model"], values=["layers.*.layer_output"])(ids), ns["staged"](ids)
    assert torch.equal(plain.logits, cut.logits) and all(torch.equal(plain[n], cut[n]) for n in plain.values)
    assert "model.layers.3.mlp.down_proj.weight" in ns["names"]
    low = ns["low"](ids)
    assert torch.equal(low.logits, plain.logits) and all(p.is_meta for p in ns["big"].parameters())


def patching(ns):
    # patching the last block's output at the last position gives the clean run's metric exactly
    ig, clean, metric = ns["ig"], ns["clean"], ns["metric"]
    last = f"layers.{len(ns['model'].model.layers) - 1}.layer_output"
    assert ns["sweep"][last].shape == (clean.shape[1],)
    torch.testing.assert_close(ns["sweep"][last][-1], metric(ig(clean).logits).detach(), rtol=0, atol=1e-5)
    heads = ns["model"].config.num_attention_heads
    assert ns["heads"]["layers.3.self_attn.attention_head_outputs"].shape == (clean.shape[1], heads)
    assert ns["scores"]["layers.2.layer_output"].shape == ns["sweep"]["layers.2.layer_output"].shape


def stages_with_loss(ns):
    # "forward and backward through the stages: parameters get .grad", and the placed stages give the values
    model, ids = ns["model"], ns["ids"]
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss = ns["fn"](model(input_ids=ids).logits)
    loss.backward()
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(expected) and abs(ns["out"].loss - loss) <= 1e-5
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    plain, placed = qgraph.instrument(model, values=["layers.*.layer_output"])(ids), ns["placed"](ids)
    assert torch.equal(plain.logits, placed.logits) and all(torch.equal(plain[n], placed[n]) for n in plain.values)


def serving(ns):
    # "as a local Output", "per-step values, as local generate", the function edit: the served checkpoint, loaded here
    local = qgraph.instrument(AutoModelForCausalLM.from_pretrained(ns["path"]), values=["layers.*.layer_output"])
    ref = local(ns["ids"], edits={"layers.1.layer_output": qgraph.Zero(positions=[-1])})
    torch.testing.assert_close(ns["out"].logits, ref.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(ns["out"]["layers.3.layer_output"], ref["layers.3.layer_output"], rtol=0, atol=1e-5)
    assert torch.equal(ns["gen"].sequences, local.generate(ns["ids"], max_new_tokens=8).sequences)
    steered = local(ns["ids"], edits={"layers.2.layer_output": lambda x: x + 4.0 * ns["v"]})
    torch.testing.assert_close(ns["steered"].logits, steered.logits, rtol=0, atol=1e-5)
    assert not torch.allclose(ns["steered"].logits, local(ns["ids"]).logits)


def viewing_a_graph(ns):
    # "from_json reads a graph file that to_json ... wrote": the same nodes and weights; the figure saves as each
    graph, again = ns["graph"], ns["again"]
    assert [n.node_id for n in again.nodes] == [n.node_id for n in graph.nodes]
    assert torch.equal(again.adjacency, graph.adjacency) and torch.equal(again.edge_mask, graph.edge_mask)
    assert again.tokens == graph.tokens == list("the cat sat")
    assert all(Path(name).stat().st_size > 1000 for name in ("graph.html", "graph.png", "graph.svg", "graph-paper.svg"))


def qwen4_saved(ns):
    # "the values and logits of ig(ids)": the loaded qwen4_exp program's, selections and n-gram embeddings included
    out, loaded = ns["out"], ns["loaded"]
    assert {"layers.3.self_attn.selected_tokens", "layers.2.ple.ngram_embeddings"} <= set(ns["ig"].values)
    for name in ns["ig"].values:
        torch.testing.assert_close(loaded[name], out[name], rtol=0, atol=1e-6)
    torch.testing.assert_close(loaded.logits, out.logits, rtol=0, atol=1e-6)


CLAIMS = {  # the section and a line of its block -> the check of what the page says it gives
    ("Reading values", "out.logits"): reading_values,
    ("The main job", "effective_attention"): main_job,
    ("Editing values", "Zero(heads=[2])"): editing_values,
    ("The tiny model, its first values and a first edit", "cached_tiny_qwen3_5()"): getting_started,
    ("Gradients", ".backward("): gradients,
    ("DeltaNet states", "states\": {}"): states,
    ("DeltaNet states", "second = ig("): continued_prompt,
    ("The DeltaNet read as attention", "rebuilt = "): delta_attention,
    ("Images", "AutoModelForImageTextToText"): images,
    ("Videos", "video_prompt("): videos,
    ("Diagrams", "qgraph.render("): diagrams,
    ("Generation", "ig.generate("): generation,
    ("Capturing a dataset", "qgraph.capture("): capturing,
    ("Sparse autoencoders", "qgraph.SAE.load("): saes,
    ("Mixtures of experts", "tiny_qwen3_5_moe("): mixtures_of_experts,
    ("Activation patching", "positions=\"each\""): patching,
    ("Saved programs", "ig.save("): saved_programs,
    ("Saved programs and serving", "qgraph.load(ig.save("): qwen4_saved,
    ("Stages", "stages=2)"): stages_cut,
    ("Gradients through the stages", "loss=fn"): stages_with_loss,
    ("Serving a lab", "qgraph.remote("): serving,
    ("Viewing a graph", "AttributionGraph.from_json("): viewing_a_graph,
}
