"""What each figure weighs on the 0.8B shape at 128 tokens (issue 57): the bytes of its HTML (the form that
answers a hover), its SVG and its PNG.

    python benchmarks/bench_figure_bytes.py [--tokens 128] [--features 128] [--threads 1]

The 0.8B shape (``common.build_0_8b``: 24 blocks, hidden 1024, random weights, sdpa), one prompt of
``--tokens`` random token ids, and the figures a researcher draws from one call: block 3's attention
pattern (8 heads), block 0's effective attention, decays and betas, its state norms, the residual grid of
every block's output, and the logit lens; then an attribution graph through random TopK transcoders
(8192 features, k = 32, every block) kept to ``--features`` features and pruned, as ``graph.plot()``
draws it. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this checkout's qgraph
from bench_circuits import transcoders  # noqa: E402
from common import build_0_8b, qwen3_5_0_8b_config  # noqa: E402

import qgraph  # noqa: E402

VALUES = {
    "pattern (block 3, 8 heads)": "layers.3.self_attn.attention_probabilities",
    "effective attention (block 0)": "layers.0.linear_attn.effective_attention",
    "decays (block 0)": "layers.0.linear_attn.decays",
    "betas (block 0)": "layers.0.linear_attn.betas",
    "state norms (block 0)": "layers.0.linear_attn.states",
    "residual grid (every block)": "layers.*.layer_output",
}


def weights(figure) -> tuple[int, int, int]:
    """Bytes of the figure's HTML, SVG and PNG."""
    return len(figure.to_html().encode()), len(figure.svg.encode()), len(figure.png())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=24, help="blocks of the 0.8B shape (fewer: a smoke test)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_0_8b(num_hidden_layers=args.blocks, layer_types=qwen3_5_0_8b_config().layer_types[:args.blocks])
    ids = torch.randint(0, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    tokens = [f"t{i}" for i in range(args.tokens)]  # the random model has no tokenizer: short labels
    ig = qgraph.instrument(model, values=[name for name in VALUES.values()])
    with torch.no_grad():
        out = ig(ids)
    rows = []
    for what, name in VALUES.items():
        rows.append((what, *weights(out.plot(name, tokens=tokens))))
    rows.append(("logit lens (every block)", *weights(ig.logit_lens(ids).plot())))
    start = time.perf_counter()
    graph = qgraph.attribution_graph(model, ids[0], transcoders(1024, args.blocks, 8192, 32),
                                     max_feature_nodes=args.features).prune()
    seconds = time.perf_counter() - start
    rows.append((f"attribution graph ({len(graph.nodes)} nodes, {int(graph.edge_mask.sum())} edges; "
                 f"{seconds:.0f} s to attribute)", *weights(graph.plot())))
    print(f"0.8B shape ({args.blocks} blocks), {args.tokens} tokens, torch {torch.__version__}\n")
    print("| figure | HTML bytes | SVG bytes | PNG bytes |\n|---|---:|---:|---:|")
    for what, html, svg, png in rows:
        print(f"| {what} | {html:,} | {svg:,} | {png:,} |")


if __name__ == "__main__":
    main()
