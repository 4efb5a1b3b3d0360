"""Qwen3.5 / Qwen3.6 mixture-of-experts (``Qwen3_5MoeForCausalLM``, and the image-text
``Qwen3_5MoeForConditionalGeneration``): Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B, Qwen3.6-35B-A3B.

Qwen3.5's blocks, mixers, rotary and vision tower (the modeling code is Qwen3.5's under another
prefix), with the MLP replaced by the sparse MoE block of ``qwen_moe``: every value of the Qwen3.5
family but the dense MLP's, and the router's, experts' and shared expert's.
"""
from dataclasses import replace

from . import qwen3_5, qwen_moe

# Qwen3.5's table with its dense MLP values swapped for the MoE block's, in the same place
_FIRST_MLP = next(i for i, spec in enumerate(qwen3_5.VALUES) if spec.host == "mlp")
VALUES = (*qwen3_5.VALUES[:_FIRST_MLP], *qwen_moe.VALUES,
          *(spec for spec in qwen3_5.VALUES[_FIRST_MLP:] if spec.host != "mlp"))

DIMS = {**{name: source for name, source in qwen3_5.DIMS.items() if name != "intermediate_size"}, **qwen_moe.DIMS}

QWEN3_5_MOE = replace(
    qwen3_5.QWEN3_5,
    name="qwen3_5_moe_text",
    model_types=("qwen3_5_moe_text",),
    classes="Qwen3_5MoeForCausalLM and Qwen3_5MoeForConditionalGeneration",
    values=VALUES,
    hosts={**qwen3_5.HOSTS, **qwen_moe.HOSTS},
    dims=DIMS,
    kernel_module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    export_patches=qwen_moe.patches,
    forward_kwargs=qwen_moe.FORWARD_KWARGS,
)
