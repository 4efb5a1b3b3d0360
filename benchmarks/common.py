"""Shared benchmark helpers: the 0.8B shape with random weights, and interleaved timing."""
from __future__ import annotations

import statistics
import time

import torch


def qwen3_5_0_8b_config(**overrides):
    """Qwen3.5-0.8B's text config (24 blocks, hidden 1024, vocab 248320), for random weights; ``overrides``
    change fields (another shape of the same architecture)."""
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(**{**dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        max_position_embeddings=262144, tie_word_embeddings=True, rms_norm_eps=1e-6), **overrides})


def build_0_8b(attn_implementation: str = "sdpa", **overrides):
    """A random-weight model of the 0.8B shape (seeded), in eval mode (``overrides``: config fields changed)."""
    from transformers import Qwen3_5ForCausalLM
    torch.manual_seed(0)
    config = qwen3_5_0_8b_config(**overrides)
    config._attn_implementation = attn_implementation
    return Qwen3_5ForCausalLM(config).eval()


def interleaved(runs: dict, repeats: int = 5, warmup: int = 1) -> dict:
    """Median seconds of each callable, run in turn (a, b, c, a, b, c, ...) after a warm-up."""
    for _ in range(warmup):
        for run in runs.values():
            run()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}
