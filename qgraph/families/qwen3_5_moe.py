"""Qwen3.5 / Qwen3.6 mixture-of-experts (``Qwen3_5MoeForCausalLM``, and the image-text
``Qwen3_5MoeForConditionalGeneration``): Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B, Qwen3.6-35B-A3B.

Qwen3.5's blocks, mixers, rotary and vision tower (the modeling code is Qwen3.5's under another
prefix), with the MLP replaced by the sparse MoE block of ``qwen_moe``: the MoE block's values at
``mlp`` where the dense MLP's were, its shared expert's host, its dims for the dense MLP's, its export
patches and forward arguments.
"""
from dataclasses import replace

from . import qwen_moe
from .qwen3_5 import QWEN3_5
from .registry import register_family

QWEN3_5_MOE = register_family(replace(
    QWEN3_5.with_host_values("mlp", qwen_moe.VALUES, hosts=qwen_moe.HOSTS, dims=qwen_moe.DIMS,
                             drop_dims=("intermediate_size",)),
    name="qwen3_5_moe_text",
    model_types=("qwen3_5_moe_text",),
    classes="Qwen3_5MoeForCausalLM and Qwen3_5MoeForConditionalGeneration",
    kernels=replace(QWEN3_5.kernels, module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"),
    export_patches=qwen_moe.patches,
    forward_kwargs=qwen_moe.FORWARD_KWARGS,
    alias_instead=qwen_moe.ALIAS_INSTEAD,
    experts_down=qwen_moe.EXPERTS_DOWN,
))
