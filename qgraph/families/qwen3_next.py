"""Qwen3-Next (``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B), text only.

The hybrid of Qwen3.5 (gated DeltaNet on three blocks in four, gated attention on the fourth) with
the sparse MoE block of ``qwen_moe`` on every block. Its DeltaNet projects q, k, v, z and b, a
with two fused projections (``in_proj_qkvz``, ``in_proj_ba``) grouped per key head; the delta-rule
kernel it calls, and so every DeltaNet value, is Qwen3.5's. Its rotary is one-dimensional
(position ids ``[batch seq]``). A block with a dense MLP (``mlp_only_layers``, or a
``decoder_sparse_step`` other than 1) would trace unlike its kind's first block: such configs are
refused (every released checkpoint has none).
"""
from dataclasses import replace

from .base import RepeatedBlocks
from .qwen3_5_moe import QWEN3_5_MOE

VALUES = tuple(spec for spec in QWEN3_5_MOE.values if not spec.host.startswith("vision"))


def _check(config) -> str | None:
    text = config.get_text_config()
    if getattr(text, "mlp_only_layers", None) or getattr(text, "decoder_sparse_step", 1) != 1:
        return (f"blocks with a dense MLP (mlp_only_layers={text.mlp_only_layers}, decoder_sparse_step="
                f"{text.decoder_sparse_step}) are not supported: qgraph serves Qwen3-Next with a MoE block on every "
                f"block, as the released checkpoints have")
    return None


QWEN3_NEXT = replace(
    QWEN3_5_MOE,
    name="qwen3_next",
    model_types=("qwen3_next",),
    classes="Qwen3NextForCausalLM",
    values=VALUES,
    hosts={host: path for host, path in QWEN3_5_MOE.hosts.items() if not host.startswith("vision")},
    dims={name: source for name, source in QWEN3_5_MOE.dims.items() if not name.startswith("vision")},
    position_rows=1,
    kernel_module="transformers.models.qwen3_next.modeling_qwen3_next",
    repeated_blocks=(RepeatedBlocks("model.layers", "layer_types"),),
    images=None,
    vision_mixer=None,
    check=_check,
)
