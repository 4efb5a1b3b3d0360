"""Render the docs gallery: the tiny Qwen3.5's blocks and model, drawn by ``qgraph.render``, and its figures
(``out.plot``, the lens, a patching sweep), drawn by ``qgraph.Figure``.

    python docs/gallery.py            # writes docs/gallery/*.svg, *.png and docs/gallery.md
    python docs/gallery.py --figures  # the figures alone (and docs/gallery.md)

The figure with its hover tooltip showing (``pattern-hover.png``) is a screenshot the Chromium test takes:
``QGRAPH_SCREENSHOTS=1 python -m pytest -m slow tests/test_figures.py``.

Needs Graphviz's ``dot`` (Debian/Ubuntu: ``apt-get install graphviz``). The tiny checkpoint is built
on first use (``qgraph.testing.cached_tiny_qwen3_5``); nothing is downloaded.
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "gallery"

# (file stem, what, layer, detail, which model (False: the tiny model, True: it instrumented, "vl": the
# image-text one, "moe": the tiny mixture of experts), caption)
PICTURES = [
    ("block3-attention", "block", 3, "modules", False,
     "Block 3, gated attention: q_proj splits per head into the query and the gate; the query is normed "
     "and rotated, attention runs as one sdpa node, and its heads' output is multiplied by sigmoid(gate) "
     "before o_proj. attention_scores and attention_probabilities are made on request (asking for them "
     "decomposes the sdpa)."),
    ("block0-deltanet", "block", 0, "modules", False,
     "Block 0, gated DeltaNet: in_proj_qkv, the causal depthwise conv and silu, the split into query, key "
     "and value, the decays and betas from in_proj_a and in_proj_b, and the delta-rule kernel node with "
     "its state in and out; the gated norm (gate: in_proj_z) and out_proj."),
    ("block3-instrumented", "block", 3, "modules", True,
     "Block 3 of an InstrumentedModel: the values it captures are orange, the edit slot is crimson."),
    ("model", "model", None, "modules", False,
     "The model: the embedding, the four blocks with their kinds, the final norm and lm_head, with the "
     "masks and the position embeddings that feed the blocks."),
    ("model-image-text", "model", None, "modules", "vl",
     "The image-text model (the tiny Qwen3.5 with a 2-block vision tower): the vision encoder, the "
     "projector, and the masked_scatter that puts the image features into the text's embeddings."),
    ("vision-block0", "vision_block", 0, "modules", "vl",
     "Vision block 0: LayerNorm pre-norm, qkv unbound per head, the 2D rotary, attention per image "
     "(one packed varlen node over every image), proj, and the GELU MLP."),
    ("moe-block1", "block", 1, "modules", "moe",
     "Block 1 of the tiny Qwen3.5 mixture of experts (8 experts, top-2): the router (mlp.gate: linear, "
     "softmax, top-k, renormalised weights), the top-k weights spread over the experts (expert_weights), "
     "the routed experts as one qgraph::moe_experts node, and the shared expert with its sigmoid gate, "
     "summed into mlp_output."),
    ("block3-ops", "block", 3, "ops", False,
     "Block 3, every graph node, clustered by module scope."),
    ("block0-ops", "block", 0, "ops", False,
     "Block 0, every graph node, clustered by module scope."),
]

# pictures the slow tests write with QGRAPH_SCREENSHOTS=1 (tests/test_graph_viewer.py: the tiny model's attribution
# graph of "the cat sat on the mat", random transcoders): (file stem, the file the picture links to, caption, call)
SCREENSHOTS = [
    ("attribution-viewer", "attribution-viewer.png",
     "The attribution-graph viewer (a self-contained HTML page) with a feature pinned: only it and its "
     "neighbours are shown, its edges drawn by their share of its strongest; the panel lists its activation "
     "and its strongest input and output edges with their weights. Tokens along the bottom ('␣' a space), "
     "logits on top with their token and probability, features filled by their influence on the logits.",
     "graph.show()"),
    ("attribution-tiny", "attribution-tiny.svg",
     "The same graph for a paper: a band per layer, each node above its token, at most about ten nodes "
     "across; the edges routed by Graphviz's neato.",
     'Path("attribution-tiny.svg").write_bytes(graph.to_graphviz().pipe("svg"))'),
]


PROMPT = "The Eiffel Tower is in Paris"

# (file stem, what it draws (from ig, its call's output `out`, the prompt's ids and a metric), caption)
FIGURES = [
    ("pattern-scale", 'out.plot("layers.3.self_attn.attention_probabilities")',
     "Block 3's attention pattern, one panel per head, query (down) × key (across), the prompt's tokens on both "
     "axes, and the colour bar they share (probabilities, from zero)."),
    ("effective-attention-scale", 'out.plot("layers.2.linear_attn.effective_attention")',
     "A DeltaNet block's effective attention: signed (the delta rule removes), so its scale diverges and is "
     "centred at zero, red above, blue below; above the diagonal is blank."),
    ("lens-grid", "ig.logit_lens(ids).plot()",
     "The logit lens: each block's top token at each position, coloured by its probability; a long prompt "
     "wraps into lines of at most 24 positions, each cell legible."),
    ("patching", 'qgraph.patch(ig, ids, ids.flip(-1), "layers.*.layer_output", metric, positions="each").plot()',
     "An activation-patching sweep: the metric after patching each block's output at each position, on a "
     "diverging scale centred at zero."),
]


def figures(lines: list[str]) -> None:
    """Draw ``FIGURES`` (PNG, and the HTML that answers a hover) and add their section to ``lines``."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import qgraph
    from qgraph.testing import cached_tiny_qwen3_5

    transformers.logging.set_verbosity_error()
    path = cached_tiny_qwen3_5()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
    ig = qgraph.instrument(model, values=["layers.3.self_attn.attention_probabilities",
                                          "layers.2.linear_attn.effective_attention"], edits=["layers.*.layer_output"])
    out = ig(ids)
    metric = lambda logits: logits[:, -1, 3].sum() - logits[:, -1, 7].sum()  # noqa: E731, F841 - FIGURES read it
    lines += ["## Figures", "",
              f"Figures of the tiny model on \"{PROMPT}\" (its weights are random, so the numbers mean nothing). "
              "Each is a `qgraph.Figure`: PNG and SVG drawn by matplotlib, and an HTML form where hovering a cell "
              "shows its value (3 significant digits) and its tokens. Click a picture for its HTML.", ""]
    for stem, code, caption in FIGURES:
        figure = eval(code)  # noqa: S307 - the gallery's own line, shown under its picture
        for suffix in ("png", "html"):
            figure.save(OUT / f"{stem}.{suffix}")
            print(f"wrote {(OUT / f'{stem}.{suffix}').relative_to(HERE.parent)}")
        lines += [f"### {stem}", "", caption, "", f"`{code}`", "", f"[![{stem}](gallery/{stem}.png)](gallery/{stem}.html)", ""]
    lines += ["### pattern-hover", "", "The pattern's HTML in Chromium, the pointer on a cell: the tooltip names the head, "
              "the query and key tokens and the value qgraph computed there (a screenshot the hover test takes).", "",
              "![pattern-hover](gallery/pattern-hover.png)", ""]


def diagrams() -> None:
    """Render ``PICTURES`` (SVG and PNG) with ``qgraph.render``."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    import qgraph
    from qgraph.render import render
    from qgraph.testing import cached_tiny_qwen3_5, tiny_qwen3_5_moe, tiny_qwen3_5_vl

    model = AutoModelForCausalLM.from_pretrained(cached_tiny_qwen3_5()).eval()
    instrumented = qgraph.instrument(model, values=["layers.3.self_attn.attention_gate", "layers.3.layer_mid",
                                                    "layers.3.self_attn.attention_head_outputs"],
                                     edits=["layers.3.mlp.mlp_neurons"])
    image_text = AutoModelForImageTextToText.from_pretrained(
        tiny_qwen3_5_vl(Path(tempfile.mkdtemp()) / "tiny-qwen3_5-vl")).eval()
    moe = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_moe(Path(tempfile.mkdtemp()) / "tiny-qwen3_5-moe")).eval()
    for stem, what, layer, detail, marked, _ in PICTURES:
        subject = {"vl": image_text, "moe": moe, True: instrumented}.get(marked, model)
        for suffix, dpi in ((".svg", None), (".png", 60 if detail == "ops" else 96)):
            path = OUT / f"{stem}{suffix}"
            render(subject, what=what, layer=layer, path=path, detail=detail, **({"dpi": dpi} if dpi else {}))
            print(f"wrote {path.relative_to(HERE.parent)}")


def diagram_lines() -> list[str]:
    """Each of ``PICTURES`` in gallery.md: its caption, the call that draws it, the picture."""
    lines = []
    for stem, what, layer, detail, marked, caption in PICTURES:
        call = f"qgraph.render({'ig' if marked is True else 'model'}, what={what!r}" + (
            f", layer={layer}" if layer is not None else "") + (f", detail={detail!r}" if detail != "modules" else "") + \
            f', path="{stem}.svg")'
        lines += [f"## {stem}", "", caption, "", f"`{call}`", "", f"[![{stem}](gallery/{stem}.png)](gallery/{stem}.svg)", ""]
    return lines


def main() -> int:
    import transformers

    transformers.logging.set_verbosity_error()
    OUT.mkdir(exist_ok=True)
    if "--figures" not in sys.argv:
        diagrams()
    lines = ["# Gallery", "",
             "Diagrams of the tiny Qwen3.5 (`qgraph.testing.cached_tiny_qwen3_5`: 3 gated DeltaNet blocks and "
             "one gated attention block), of its image-text version (`qgraph.testing.tiny_qwen3_5_vl`) and of the "
             "tiny mixture of experts (`qgraph.testing.tiny_qwen3_5_moe`), drawn "
             "by `qgraph.render` from the exported graph: boxes are module scopes and the ops between them, "
             "yellow tap points are the standard values, each labelled `name [layout]`. Click a picture for "
             "its SVG (hover a part for its full name and description). Regenerate with "
             "`python docs/gallery.py` (needs Graphviz's `dot`); the [figures](#figures) alone with "
             "`python docs/gallery.py --figures`; the attribution graph's pictures at the end with "
             "`QGRAPH_SCREENSHOTS=1 python -m pytest -m slow tests/test_graph_viewer.py`.", "", *diagram_lines()]
    figures(lines)
    for stem, target, caption, call in SCREENSHOTS:
        lines += [f"## {stem}", "", caption, "", f"`{call}`", "", f"[![{stem}](gallery/{stem}.png)](gallery/{target})", ""]
    (HERE / "gallery.md").write_text("\n".join(lines))
    print(f"wrote {(HERE / 'gallery.md').relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
