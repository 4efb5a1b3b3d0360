"""One record for a sparse autoencoder, whatever format it was loaded from (``formats.py``).

The conventions, made explicit (every format is converted to these on loading):

    W_enc [d_in, d_sae]   b_enc [d_sae]   W_dec [d_sae, d_in]   b_dec [d_in]   threshold [d_sae] (JumpReLU)

    pre      = (x - b_dec if subtract_b_dec else x) @ W_enc + b_enc
    features = relu(pre)                                   activation "relu" (SAELens "standard")
             = relu(pre) * (pre > threshold)               activation "jumprelu" (SAELens's JumpReLU)
             = the k largest of pre per token, others 0    activation "topk"; their values relu'd
                                                           when topk_relu (SAELens, sparsify), raw
                                                           when not (Qwen-Scope's own encoder)
    x_hat    = features @ W_dec + b_dec

TopK in the libraries: SAELens takes ``topk(pre)`` and relus the kept values; sparsify takes
``topk(relu(pre))``. Densely they are the same: relu is monotonic, so both keep the positive entries
among the k largest of ``pre`` and zeros elsewhere (where fewer than k are positive, sparsify's
extra picks are zeros). One implementation serves both. Qwen-Scope's model card encodes with
``topk(pre)`` and no relu, so a kept value can be negative: ``topk_relu=False`` reproduces it (with
k = 50 of 32K features the k largest are positive in practice, and the two agree).

A TopK SAE's sparse form, ``select(x) -> (activations, indices)`` ``[..., k]``, is the encoder's own
selection (``encode(x) == dense(*select(x))``); the dense features cannot give it back: a raw value
can be negative (below the zeros of the unselected features) and a relu'd one is zero like them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InvalidArgument, OutOfRange

ACTIVATIONS = ("topk", "jumprelu", "relu")


class SAE(torch.nn.Module):
    """A sparse autoencoder reading ``d_in``-wide vectors (the value named ``hook``) into ``d_sae``
    features. Load one with ``SAE.load(path, layer=i)``; its weights are frozen parameters."""

    # what it decodes to: the vectors it reads (W_dec [d_sae, d_in]); a transcoder (``transcoder.py``)
    # decodes to b_dec's own width, its d_out
    decodes_input = True

    def __init__(self, W_enc: Tensor, b_enc: Tensor, W_dec: Tensor, b_dec: Tensor, activation: str,
                 k: int | None = None, threshold: Tensor | None = None, subtract_b_dec: bool = False,
                 topk_relu: bool = True, hook: str | None = None, source: str = "an SAE made in memory"):
        super().__init__()
        self.source = source
        if activation not in ACTIVATIONS:
            raise InvalidArgument(f"{source}: activation {activation!r} is not one of {ACTIVATIONS}")
        _check_shapes(source, W_enc, b_enc, W_dec, b_dec, threshold, activation, self.decodes_input)
        self.d_in, self.d_sae = W_enc.shape
        if activation == "topk":
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.d_sae:
                raise InvalidArgument(f"{source}: a TopK SAE needs k from 1 to its d_sae {self.d_sae}, not {k!r}")
        elif k is not None:
            raise InvalidArgument(f"{source}: k={k!r} is for TopK SAEs; this one is {activation}")
        self.activation, self.k = activation, k
        self.subtract_b_dec, self.topk_relu, self.hook = bool(subtract_b_dec), bool(topk_relu), hook
        dtype = W_enc.dtype
        self.W_enc = frozen(W_enc, dtype)
        self.b_enc = frozen(b_enc, dtype)
        self.W_dec = frozen(W_dec, dtype)
        self.b_dec = frozen(b_dec, dtype)
        if threshold is not None:  # a JumpReLU SAE's, and only its (_check_shapes)
            self.threshold = frozen(threshold, dtype)
        else:
            self.register_parameter("threshold", None)

    @classmethod
    def load(cls, path, layer: int | None = None, k: int | None = None, hook: str | None = None, *,
             sae_id: str | None = None, revision: str | None = None) -> SAE:
        """The SAE stored at ``path`` in any of the formats ``formats.py`` reads: Qwen-Scope, SAELens or
        sparsify. ``path`` is a local file or folder, or a Hugging Face Hub repository id (``"org/repo"``,
        at ``revision``: ``hub.py`` fetches only the files the SAE needs); ``sae_id`` names the SAE's
        folder in it (a SAELens release's SAE id). ``layer`` picks one of a folder of layers; ``k``
        overrides (or, for Qwen-Scope without ``L0_<k>`` in the path, supplies) a TopK SAE's k; ``hook``
        overrides the value the SAE reads, where the format's name for it does not say."""
        from .formats import read  # lazy: qgraph.saes.formats imports this module's package at import time (a cycle)
        from .hub import local  # lazy: hub imports formats (the same cycle)
        record = read(local(path, "SAE", sae_id, revision, layer, "sae_id"), layer=layer, k=k)
        if hook is not None:
            record["hook"] = hook
        return cls(**record)

    def encode(self, x: Tensor) -> Tensor:
        """The dense features ``[..., d_sae]`` of ``x`` ``[..., d_in]``, in ``x``'s dtype (a TopK SAE's
        are ``dense(*select(x))``)."""
        if self.activation == "topk":
            return self.dense(*self.select(x))
        pre = self.pre(x)
        features = torch.relu(pre)
        if self.activation == "jumprelu":
            features = features * (pre > self.threshold).to(pre.dtype)
        return features.to(x.dtype)

    def select(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """A TopK SAE's own sparse form of ``x``'s features: ``(activations, indices)``, each ``[..., k]``,
        the encoder's selection (the k largest pre-activations per token, largest first) and their
        values after the activation (relu'd when ``topk_relu``, raw, possibly negative, when not)."""
        if self.activation != "topk" or self.k is None:  # a TopK SAE has its k (checked when made)
            raise InvalidArgument(f"{self.source}: the sparse form is a TopK SAE's (k features per token); this one "
                                  f"is {self.activation}: read encode(x)")
        values, indices = self.pre(x).topk(self.k, dim=-1)
        return (torch.relu(values) if self.topk_relu else values).to(x.dtype), indices

    def dense(self, activations: Tensor, indices: Tensor) -> Tensor:
        """The dense features ``[..., d_sae]`` of a sparse form (``select``'s, or one captured):
        ``activations`` at ``indices``, zeros elsewhere."""
        zeros = activations.new_zeros(*activations.shape[:-1], self.d_sae)
        return zeros.scatter(-1, indices.long(), activations)

    def pre(self, x: Tensor) -> Tensor:
        """The pre-activations ``[..., d_sae]`` (what the activation function reads), in the SAE's dtype."""
        sae_in = x.to(self.W_enc.dtype)
        if self.subtract_b_dec:
            sae_in = sae_in - self.b_dec
        return sae_in @ self.W_enc + self.b_enc

    def decode(self, features: Tensor) -> Tensor:
        """``features @ W_dec + b_dec``: ``[..., d_sae] -> [..., d_in]``, in ``features``' dtype."""
        return (features.to(self.W_dec.dtype) @ self.W_dec + self.b_dec).to(features.dtype)

    def forward(self, x: Tensor) -> Tensor:
        """The reconstruction of ``x``: ``decode(encode(x))``."""
        return self.decode(self.encode(x))

    def direction(self, j: int) -> Tensor:
        """Feature ``j``'s decoder direction ``W_dec[j]`` ``[d_in]`` (what one unit of it adds)."""
        if not isinstance(j, int) or not -self.d_sae <= j < self.d_sae:
            raise OutOfRange(f"feature {j!r}: {self.source} has features 0 to {self.d_sae - 1}")
        return self.W_dec[j]

    def check_fits(self, hidden_size: int, name: str) -> None:
        """A ValueError unless the SAE reads vectors as wide as the value ``name`` (``hidden_size``)."""
        if self.d_in != hidden_size:
            raise InvalidArgument(f"{self.source} reads vectors of d_in={self.d_in}, but '{name}' has {hidden_size}: "
                                  f"load the SAE trained on this model and value")

    def extra_repr(self) -> str:
        """The SAE's widths, activation and where it reads, for its repr."""
        kind = f"topk k={self.k}" + ("" if self.topk_relu else " (raw values)") if self.activation == "topk" \
            else self.activation
        return (f"{kind}, d_in={self.d_in}, d_sae={self.d_sae}, subtract_b_dec={self.subtract_b_dec}, "
                f"hook={self.hook!r}, dtype={self.W_enc.dtype}, source={self.source!r}")


def frozen(tensor: Tensor, dtype: torch.dtype) -> torch.nn.Parameter:
    """A parameter holding ``tensor`` (no copy where it already has ``dtype``), without gradients:
    the SAE is read and edited, not trained."""
    return torch.nn.Parameter(tensor.detach().to(dtype), requires_grad=False)


def _check_shapes(source: str, W_enc, b_enc, W_dec, b_dec, threshold, activation: str,
                  decodes_input: bool = True) -> None:
    """A ValueError naming ``source`` and the tensor when the record's shapes disagree (a transcoder's,
    ``decodes_input=False``, decodes to b_dec's width, its d_out, rather than to d_in)."""
    if not isinstance(W_enc, Tensor) or W_enc.dim() != 2:
        raise InvalidArgument(f"{source}: W_enc should be a [d_in, d_sae] tensor, not {shape_of(W_enc)}")
    d_in, d_sae = W_enc.shape
    if not decodes_input and (not isinstance(b_dec, Tensor) or b_dec.dim() != 1):
        raise InvalidArgument(f"{source}: b_dec should be a [d_out] tensor, not {shape_of(b_dec)}")
    d_out = d_in if decodes_input else b_dec.shape[0]
    expected = {"b_enc": (b_enc, (d_sae,)), "W_dec": (W_dec, (d_sae, d_out)), "b_dec": (b_dec, (d_out,))}
    if activation == "jumprelu":
        expected["threshold"] = (threshold, (d_sae,))
    elif threshold is not None:
        raise InvalidArgument(f"{source}: a threshold is for JumpReLU SAEs; this one is {activation}")
    for name, (tensor, shape) in expected.items():
        if not isinstance(tensor, Tensor) or tuple(tensor.shape) != shape:
            makes = "makes" if decodes_input else f"and b_dec [d_out={d_out}] make"
            raise InvalidArgument(f"{source}: {name} has shape {shape_of(tensor)}, but W_enc [d_in={d_in}, "
                                  f"d_sae={d_sae}] {makes} it {list(shape)}")


def shape_of(tensor) -> str:
    return str(list(tensor.shape)) if isinstance(tensor, Tensor) else type(tensor).__name__
