"""Mixture-of-experts: exporting a 35B-A3B- (or 397B-A17B-) shaped twin on the meta device, and the forward's overhead.

    python benchmarks/bench_moe.py [--shape 35b|397b] [--tokens 128] [--skip-meta] [--skip-instrument] [--skip-forward]

1. Export (``qgraph.export.export_model``) of a ``Qwen3_5MoeForCausalLM`` built under
   ``torch.device("meta")`` (no weights) with Qwen3.5-35B-A3B's text shape (``--shape 35b``, the
   default) or Qwen3.5-397B-A17B's (``--shape 397b``): wall time, node count of the
   program's graph (and its ``qgraph::moe_experts`` / ``qgraph::mark`` nodes) and the peak resident
   memory (``ru_maxrss``) before and after. Then, on the same twin (its export now in memory),
   ``qgraph.instrument(model, values=["layers.*.layer_output"], logits=False)``: wall time, the
   program's node count, resident and peak resident memory after, and a check that every parameter
   is still on meta (``--skip-instrument`` leaves it out).

   35B-A3B (``--shape 35b``): hidden 2048, 40 blocks (3 Gated DeltaNet + 1
   full attention, repeated), 16 query / 2 key-value heads of 256, DeltaNet 16 key / 32 value heads of
   128, conv kernel 4, 256 experts, top-8, expert inner 512, shared expert inner 512, vocab 248320,
   partial rotary 0.25 with mrope_section [11, 11, 10] interleaved. The spec (/work/shared/spec) names
   35B-A3B as ``qwen3_5_moe_text`` but lists no config values; these are the values the issue gave,
   and they agree with transformers 5.24's ``Qwen3_5MoeTextConfig()`` defaults, whose docstring names
   Qwen/Qwen3.5-35B-A3B. rope_theta 10,000,000 and 262,144 positions as Qwen3.5's released configs
   (``common.qwen3_5_0_8b_config``); untied embeddings (the config's default).

   397B-A17B (``--shape 397b``): hidden 4096, 60 blocks (15 x (3 Gated DeltaNet + 1 full attention)),
   32 query / 2 key-value heads of 256, DeltaNet 16 key / 64 value heads of 128, conv kernel 4, 512
   experts, top-10, expert inner 1024, shared expert inner 1024 (one shared expert, gated), vocab
   248320, untied embeddings, rms_norm_eps 1e-6, rope_theta 10,000,000, partial rotary 0.25, 262,144
   positions. Qwen/Qwen3.5-397B-A17B's config.json itself was not found (no copy in the sources
   searched); these values come from two secondary sources that agree where they overlap: NVIDIA
   Megatron's MIMO example config for Qwen3.5-397B-A17B (``get_qwen35_language_model_config``, which
   says its values "match the HuggingFace text_config": 60 layers, hidden 4096, 32 heads, 2 KV groups
   of 256, 512 experts, moe_ffn_hidden_size 1024, shared expert 1024, top-10, linear 16 key / 64
   value heads of 128, conv 4, linear_attention_freq 4, rotary 0.25 of base 1e7, 262144 positions,
   eps 1e-6, untied) and mlx-community/Qwen3.5-397B-A17B-4bit's model card (the same, and vocab
   248320). Assumed, not found in either: mrope_section [11, 11, 10] interleaved (as 35B-A3B's: the
   same head dim 256, so the same 32 rotary pairs), ``intermediate_size`` left at the config's
   default (unused: every block is MoE), and the other ``Qwen3_5MoeTextConfig`` defaults
   (``norm_topk_prob``, ``hidden_act``, ...).
2. Forward on a small MoE shape (hidden 512, 8 blocks, 32 experts, top-4, expert inner 256, shared
   inner 256, vocab 32000; random weights, float32, sdpa), batch 1, under ``torch.no_grad()``: for
   each experts implementation (``--implementations``, default grouped_mm (HF's default), batched_mm,
   eager; each on a deep copy set to it), the HF forward and ``qgraph.instrument(copy)`` with no
   values (its experts op runs that implementation: logits checked bit-equal), and an instrument of
   every block's layer_output and routing values on the default. All interleaved in one run, median
   of ``--repeats`` (default 7) after a warm-up; printed as ratios: qgraph with no values over the HF
   forward with the default implementation (goal <= 1.05x), and qgraph over HF per implementation,
   with the load average (``os.getloadavg``) before and after the timing.

Exports go to a temporary ``$QGRAPH_CACHE`` (removed at the end), so the export is cold and no
program is left in the user's cache.
"""
from __future__ import annotations

import argparse
import copy
import os
import resource
import tempfile
import time
import traceback

import torch

from common import interleaved

ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True}


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def config_35b_a3b():
    from transformers import Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        rope_parameters=dict(ROPE), max_position_embeddings=262144, rms_norm_eps=1e-6)


def config_397b_a17b():
    """Qwen3.5-397B-A17B's text shape (see the module docstring for the sources and what is assumed)."""
    from transformers import Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig(
        vocab_size=248320, hidden_size=4096, num_hidden_layers=60,
        num_attention_heads=32, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 15,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
        rope_parameters=dict(ROPE), max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False)


SHAPES = {"35b": ("35B-A3B", config_35b_a3b), "397b": ("397B-A17B", config_397b_a17b)}


def config_small():
    from transformers import Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig(
        vocab_size=32000, hidden_size=512, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=256,
        rope_parameters={**ROPE, "mrope_section": [6, 5, 5]},  # 0.25 x 128 = 32 rotary dims: 16 pairs
        max_position_embeddings=262144, rms_norm_eps=1e-6)


def count(graph, name: str) -> int:
    return sum(1 for node in graph.nodes if node.op == "call_function" and name in str(node.target))


def meta_export(shape: str = "35b"):
    """Export the twin of ``shape`` built on meta; returns the model (None if the export failed)."""
    from transformers import Qwen3_5MoeForCausalLM
    from qgraph.export import export_model
    name, config = SHAPES[shape]
    print(f"== export of the {name}-shaped twin on meta ==")
    rss0, peak0 = rss_mib(), maxrss_mib()
    start = time.perf_counter()
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(config()).eval()
    build = time.perf_counter() - start
    parameters = sum(p.numel() for p in model.parameters())
    print(f"built on meta in {build:.1f} s: {parameters / 1e9:.2f} B parameters "
          f"({parameters * 2 / 2**30:.0f} GiB in bf16, none allocated), "
          f"experts implementation {model.config._experts_implementation!r}")
    rss1, peak1 = rss_mib(), maxrss_mib()
    print(f"RSS before export: {rss1:.0f} MiB (at start {rss0:.0f}), peak RSS before export: {peak1:.0f} MiB "
          f"(at start {peak0:.0f})")
    start = time.perf_counter()
    try:
        exported = export_model(model)
    except Exception:
        print(f"export FAILED after {time.perf_counter() - start:.1f} s:")
        traceback.print_exc()
        print(f"RSS after: {rss_mib():.0f} MiB, peak RSS after: {maxrss_mib():.0f} MiB")
        return None
    seconds = time.perf_counter() - start
    graph = exported.graph
    nodes = len(graph.nodes)
    print(f"export: {seconds:.1f} s (ExportedModel.seconds {exported.seconds:.1f}, from cache {exported.from_cache})")
    print(f"graph: {nodes} nodes, {count(graph, 'moe_experts')} qgraph::moe_experts, "
          f"{count(graph, 'qgraph.mark')} qgraph::mark, "
          f"{count(graph, 'chunk_gated_delta_rule')} qgraph::chunk_gated_delta_rule")
    print(f"RSS after export: {rss_mib():.0f} MiB, peak RSS after export: {maxrss_mib():.0f} MiB "
          f"(+{maxrss_mib() - peak1:.0f} MiB over the peak before)")
    from qgraph.export import disk_cache
    cached = list(disk_cache.directory().glob("*.json")) if disk_cache.directory().is_dir() else []
    print(f"disk cache: {len(cached)} file(s), {sum(f.stat().st_size for f in cached) / 2**20:.1f} MiB")
    return model


def meta_instrument(model) -> None:
    """``qgraph.instrument`` of every block's layer_output, logits=False, on the meta twin (export in memory)."""
    import qgraph
    print("== instrument(values=['layers.*.layer_output'], logits=False) on the same meta twin ==")
    rss1, peak1 = rss_mib(), maxrss_mib()
    print(f"RSS before: {rss1:.0f} MiB, peak RSS before: {peak1:.0f} MiB")
    start = time.perf_counter()
    try:
        ig = qgraph.instrument(model, values=["layers.*.layer_output"], logits=False)
    except Exception:
        print(f"instrument FAILED after {time.perf_counter() - start:.1f} s:")
        traceback.print_exc()
        print(f"RSS after: {rss_mib():.0f} MiB, peak RSS after: {maxrss_mib():.0f} MiB")
        return
    seconds = time.perf_counter() - start
    graph = ig.graph
    off_meta = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.device.type != "meta"]
    print(f"instrument: {seconds:.1f} s, {len(ig.values)} values, program graph {len(graph.nodes)} nodes "
          f"({count(graph, 'moe_experts')} qgraph::moe_experts)")
    print(f"RSS after instrument: {rss_mib():.0f} MiB (+{rss_mib() - rss1:.0f}), peak RSS after: {maxrss_mib():.0f} MiB "
          f"(+{maxrss_mib() - peak1:.0f} MiB over the peak before)")
    print(f"parameters and buffers off meta after instrument: {len(off_meta)} {off_meta[:5]}")
    start = time.perf_counter()
    qgraph.instrument(model, values=["layers.*.layer_output"], logits=False)
    print(f"instrument again (program built anew from the export in memory): {time.perf_counter() - start:.1f} s, "
          f"peak RSS {maxrss_mib():.0f} MiB")


def forward(tokens: int, implementations=("grouped_mm", "batched_mm", "eager"), repeats: int = 7) -> None:
    import qgraph
    from transformers import Qwen3_5MoeForCausalLM
    print(f"== forward, small MoE shape, {tokens} tokens ==")
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(config_small()).eval()
    default = model.config._experts_implementation
    models = {default: model}
    for implementation in implementations:
        if implementation not in models:
            models[implementation] = copy.deepcopy(model)
            models[implementation].set_experts_implementation(implementation)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{parameters / 1e6:.0f} M parameters; HF default experts implementation {default!r}; "
          f"torch threads {torch.get_num_threads()}")
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    values = ["layers.*.layer_output", "layers.*.mlp.router_logits", "layers.*.mlp.router_weights",
              "layers.*.mlp.router_indices", "layers.*.mlp.expert_weights"]
    programs = {}
    for implementation, twin in models.items():
        start = time.perf_counter()
        programs[implementation] = qgraph.instrument(twin)
        print(f"instrument() with {implementation} experts: {time.perf_counter() - start:.1f} s (export)")
    routed = qgraph.instrument(model, values=values)
    runs = {}
    for implementation, twin in models.items():
        runs[f"HF {implementation}"] = lambda twin=twin: twin(input_ids=ids)
        runs[f"qgraph {implementation}"] = lambda program=programs[implementation]: program(ids)
    runs[f"qgraph {default}, layer_output + routing"] = lambda: routed(ids)
    with torch.no_grad():
        hf = {implementation: twin(input_ids=ids).logits for implementation, twin in models.items()}
        for implementation, program in programs.items():
            logits = program(ids).logits
            print(f"{implementation}: qgraph logits equal HF's bit for bit: {torch.equal(logits, hf[implementation])} "
                  f"(max abs diff {(logits - hf[implementation]).abs().max().item():.1e}; "
                  f"HF {implementation} vs HF {default} {(hf[implementation] - hf[default]).abs().max().item():.1e})")
        out = routed(ids)
        captured = sum(t.numel() * t.element_size() for t in out.values.values())
        print(f"values captured: {len(out.values)} ({captured / 2**20:.1f} MiB)")
        load = os.getloadavg()
        times = interleaved(runs, repeats=repeats)
        after = os.getloadavg()
    print(f"median of {repeats}, interleaved:")
    for name, seconds in times.items():
        print(f"  {name:42s} {seconds * 1000:8.1f} ms  {seconds / times[f'HF {default}']:5.3f}x HF {default}")
    ratio = times[f"qgraph {default}"] / times[f"HF {default}"]
    print(f"qgraph (no values) / HF forward, default implementation {default}: {ratio:.3f}x (goal <= 1.05x)")
    for implementation in models:
        print(f"qgraph / HF with {implementation} experts: "
              f"{times[f'qgraph {implementation}'] / times[f'HF {implementation}']:.3f}x")
    print(f"load average (1, 5, 15 min) before timing {' '.join(f'{x:.2f}' for x in load)}, "
          f"after {' '.join(f'{x:.2f}' for x in after)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="35b",
                        help="the MoE shape exported on meta: Qwen3.5-35B-A3B (default) or Qwen3.5-397B-A17B")
    parser.add_argument("--skip-meta", action="store_true")
    parser.add_argument("--skip-instrument", action="store_true", help="export only, no instrument() on meta")
    parser.add_argument("--skip-forward", action="store_true")
    parser.add_argument("--implementations", default="grouped_mm,batched_mm,eager",
                        help="the experts implementations the forward compares (comma-separated)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each forward (the median is shown)")
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["QGRAPH_CACHE"] = cache
        if not args.skip_meta:
            model = meta_export(args.shape)
            if model is not None and not args.skip_instrument:
                meta_instrument(model)
            del model  # the meta twin, before the forward's models
        if not args.skip_forward:
            forward(args.tokens, tuple(args.implementations.split(",")), args.repeats)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
