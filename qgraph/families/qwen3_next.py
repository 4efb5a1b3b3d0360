"""Qwen3-Next (``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B), text only.

The hybrid of Qwen3.5 (gated DeltaNet on three blocks in four, gated attention on the fourth) with
the sparse MoE block of ``qwen_moe`` on every block: Qwen3.5-MoE's values without its image part.
Its DeltaNet projects q, k, v, z and b, a with two fused projections (``in_proj_qkvz``,
``in_proj_ba``) grouped per key head; the delta-rule kernel it calls (its own module's copy), and so
every DeltaNet value, is Qwen3.5's. Its rotary is one-dimensional
(position ids ``[batch seq]``). A block with a dense MLP (``mlp_only_layers``, or a
``decoder_sparse_step`` other than 1) would trace unlike its kind's first block: such configs are
refused (every released checkpoint has none).
"""
from dataclasses import replace

from .base import RepeatedBlocks
from .qwen3_5_moe import QWEN3_5_MOE
from .registry import register_family


def _check(config) -> str | None:
    text = config.get_text_config()
    if getattr(text, "mlp_only_layers", None) or getattr(text, "decoder_sparse_step", 1) != 1:
        return (f"blocks with a dense MLP (mlp_only_layers={text.mlp_only_layers}, decoder_sparse_step="
                f"{text.decoder_sparse_step}) are not supported: qgraph serves Qwen3-Next with a MoE block on every "
                f"block, as the released checkpoints have")
    return None


QWEN3_NEXT = register_family(replace(
    QWEN3_5_MOE.without_images(),
    name="qwen3_next",
    model_types=("qwen3_next",),
    classes="Qwen3NextForCausalLM",
    position_rows=1,
    kernels=replace(QWEN3_5_MOE.kernels, module="transformers.models.qwen3_next.modeling_qwen3_next"),
    repeated_blocks=(RepeatedBlocks("model.layers", "layer_types"),),
    check=_check,
))
