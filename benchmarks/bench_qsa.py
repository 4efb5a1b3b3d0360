"""QSA's token selection: transformers' loop against qgraph's vectorized selection (issue 58).

    taskset -c 1 env OMP_NUM_THREADS=1 python benchmarks/bench_qsa.py [--tokens 128 512] [--batch 1 2]

One ``Qwen4ExpTextQSAIndexer`` of a 0.8B-like shape (hidden 1024, head_dim 256 with partial rotary 0.25;
the indexer's 16 heads of 128, a budget of 64 tokens in blocks of 4: the released config's indexer values
were not found, these are assumed), random weights, float32, on CPU. Its inputs (the index queries, the
raw keys, the rotary, the causal mask under sdpa: bool) are made once per prompt by its own forward; then
``_select_tokens`` is timed as transformers runs it (a loop over rows and queries) and as the program runs
it (``qgraph.families.qwen4_exp.select_tokens``: ``kernels.qsa.block_scores`` and ``qgraph::qsa_select``),
interleaved, median of 5 after a warm-up. Each prompt's rows after the first are left-padded (a quarter of
the row per row) and both selections are checked equal first.
"""
from __future__ import annotations

import argparse

import torch

from common import interleaved


def build(tokens: int, batch: int):
    from transformers import Qwen4ExpTextConfig
    from transformers.masking_utils import create_causal_mask
    from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling
    config = Qwen4ExpTextConfig(
        hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=256, num_hidden_layers=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=64, indexer_compress_ratio=4)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    indexer = modeling.Qwen4ExpTextQSAIndexer(config, layer_idx=3).eval()
    rotary = modeling.Qwen4ExpTextRotaryEmbedding(config)
    hidden = torch.randn(batch, tokens, 1024)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    for row in range(1, batch):
        mask[row, :row * tokens // 4] = 0
    positions = torch.arange(tokens).expand(3, batch, -1)
    cos, sin = rotary(hidden, positions)
    causal = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=mask, cache=None,
                                position_ids=positions[0], allow_is_causal_skip=False)
    seen = {}
    original = type(indexer)._select_tokens
    indexer._select_tokens = lambda *args, **kwargs: seen.setdefault("args", args)  # the loop's inputs
    with torch.no_grad():
        indexer(hidden, (cos, sin), causal, None)
    del indexer._select_tokens
    return indexer, original, seen["args"]


def main():
    from qgraph.families.qwen4_exp import select_tokens
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| tokens | batch | transformers' loop | qgraph (vectorized + qgraph::qsa_select) | speed-up |")
    print("|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        for batch in args.batch:
            indexer, loop, inputs = build(tokens, batch)
            with torch.no_grad():
                assert torch.equal(loop(indexer, *inputs), select_tokens(indexer, *inputs))
                times = interleaved({"loop": lambda i=indexer, f=loop, a=inputs: f(i, *a),
                                     "qgraph": lambda i=indexer, a=inputs: select_tokens(i, *a)})
            print(f"| {tokens} | {batch} | {times['loop'] * 1e3:.1f} ms | {times['qgraph'] * 1e3:.2f} ms | "
                  f"{times['loop'] / times['qgraph']:.0f}x |", flush=True)


if __name__ == "__main__":
    main()
