"""Reading an instrumented model's SAE features: the most active features of each token."""
from __future__ import annotations

import weakref

import torch

from ..values.saes import prefix_of

# an instrumented model -> the instrumented twins that read its SAEs' features (when it does not itself)
_READERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def top_features(ig, input_ids, layer: int, k: int = 10, attention_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(activations, features)``, each ``[batch, seq, k]``: the ``k`` most active features of the SAE
    spliced at block ``layer`` for every token, largest first (``ig``'s edits are not applied)."""
    blocks = len(ig.family.kinds(ig.config))
    if not isinstance(layer, int) or not -blocks <= layer < blocks:
        raise IndexError(f"layer={layer!r}: the model has blocks 0 to {blocks - 1}")
    prefix = f"layers.{layer % blocks}"
    hooks = [hook for hook in ig.saes if prefix_of(hook) == prefix]
    if not hooks:
        spliced = sorted(prefix_of(hook) for hook in ig.saes) or "none"
        raise ValueError(f"no SAE is spliced at block {layer % blocks} (SAEs at: {spliced}): instrument with "
                         f"saes={{'{prefix}.layer_output': sae}}")
    name = f"{prefix}.sae.features"
    sae, splice = ig.saes[hooks[0]]
    if not isinstance(k, int) or not 1 <= k <= sae.d_sae:
        raise ValueError(f"k={k!r}: give a number of features from 1 to the SAE's {sae.d_sae}")
    reader = ig
    if name not in ig.values:
        readers = _READERS.setdefault(ig, {})
        if name not in readers:
            readers[name] = type(ig)(ig.model, [name], logits=False, saes={hooks[0]: sae}, splice=splice)
        reader = readers[name]
    with torch.no_grad():
        features = reader(input_ids, attention_mask)[name]
    return features.topk(k, dim=-1)
