"""Reading an instrumented model's SAE features: the most active features of each token."""
from __future__ import annotations

import torch

from ..errors import InvalidArgument, OutOfRange
from ..values.dictionaries import prefixes


def top_features(ig, input_ids, layer: int | None = None, k: int = 10, attention_mask=None,
                 value: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(activations, features)``, each ``[batch, seq, k]``: the ``k`` most active features of the SAE
    spliced at block ``layer`` for every token, largest first, as ``ig`` runs (its other SAEs and its
    fixed edits in place: ``ig.variant``). Where the block has several SAEs (at its input and its
    output, say), ``value`` names the one by the value it reads (``"layers.1.layer_input"``)."""
    hook = _pick(ig, layer, value)
    sae = ig.saes[hook][0]
    if not isinstance(k, int) or not 1 <= k <= sae.d_sae:
        raise InvalidArgument(f"k={k!r}: give a number of features from 1 to the SAE's {sae.d_sae}")
    names = [f"{prefix}.sae.features" for prefix in prefixes(ig.saes)[hook]]
    name = next((name for name in names if name in ig.values), names[0])
    reader = ig if name in ig.values else ig.variant([name], logits=False)
    with torch.no_grad():
        features = reader(input_ids, attention_mask)[name]
    return features.topk(k, dim=-1)


def _pick(ig, layer: int | None, value: str | None) -> str:
    """The hook of the one SAE that ``layer`` (a block) and ``value`` (the value it reads) pick."""
    hooks, asked = list(ig.saes), []
    if layer is not None:
        blocks = len(ig.family.kinds(ig.config))
        if not isinstance(layer, int) or not -blocks <= layer < blocks:
            raise OutOfRange(f"layer={layer!r}: the model has blocks 0 to {blocks - 1}")
        layer %= blocks
        hooks, asked = [hook for hook in hooks if hook.startswith(f"layers.{layer}.")], [f"block {layer}"]
    if value is not None:
        named = ig.resolve(value)
        hooks, asked = [hook for hook in hooks if hook in named], [*asked, f"'{value}'"]
    where = " and ".join(asked) or "this model"
    if not hooks:
        example = value or f"layers.{layer or 0}.layer_output"
        raise InvalidArgument(f"no SAE is spliced at {where} (SAEs at: {sorted(ig.saes) or 'none'}): instrument with "
                              f"saes={{'{example}': sae}}")
    if len(hooks) > 1:
        raise InvalidArgument(f"{where} has {len(hooks)} SAEs ({', '.join(hooks)}): pick one with value=, e.g. "
                              f"value='{hooks[0]}'")
    return hooks[0]
