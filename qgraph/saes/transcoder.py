"""One record for a per-layer transcoder: it reads a block's MLP input and writes what its MLP outputs.

The conventions are the SAE's (``sae.py``) for the encoder, with a decoder to ``d_out`` (the MLP output's
width) and an optional linear skip path; every format (``transcoder_formats.py``) is converted to them:

    W_enc [d_in, d_sae]   b_enc [d_sae]   W_dec [d_sae, d_out]   b_dec [d_out]   threshold [d_sae] (JumpReLU)
    W_skip [d_in, d_out] (or none)

    pre      = x @ W_enc + b_enc                  b_dec is never subtracted: it is the output's
    features = relu(pre) | relu(pre) * (pre > threshold) | the k largest of pre    (as an SAE's)
    decode   = features @ W_dec + b_dec
    skip     = x @ W_skip                          (0 without W_skip)
    output   = decode(features) + skip(x)          what stands in for the MLP's output

Both libraries store ``W_skip`` as ``[d_out, d_in]`` and compute ``x @ W_skip.T``; the record keeps it
transposed, ``x @ W_skip``, as it keeps ``W_enc``. ``layer`` is the block it belongs to where the format
says; ``reads`` is the value of that block it reads: ``mlp_input`` (the output of
``post_attention_layernorm``: circuit-tracer's ``mlp.hook_in`` / ``ln2.hook_normalized``), or
``layer_mid`` for a set trained on ``hook_resid_mid`` (the stream before that norm).
"""
from __future__ import annotations

from torch import Tensor

from ..errors import InvalidArgument
from .sae import SAE, frozen, shape_of
from .transcoder_formats import READS, WRITES, read



class Transcoder(SAE):
    """A per-layer transcoder: ``d_in``-wide MLP inputs into ``d_sae`` features, decoded to ``d_out``-wide
    MLP outputs. Load one with ``Transcoder.load(path, layer=i)``; splice it with
    ``qgraph.instrument(model, transcoders={i: transcoder})``. Its weights are frozen parameters."""

    decodes_input = False  # W_dec [d_sae, d_out], b_dec [d_out]

    def __init__(self, W_enc: Tensor, b_enc: Tensor, W_dec: Tensor, b_dec: Tensor, activation: str,
                 k: int | None = None, threshold: Tensor | None = None, W_skip: Tensor | None = None,
                 topk_relu: bool = True, layer: int | None = None, reads: str = "mlp_input",
                 source: str = "a transcoder made in memory"):
        if reads not in READS:
            raise InvalidArgument(f"{source}: reads={reads!r}: a transcoder reads one of {READS} of its block")
        if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool) or layer < 0):
            raise InvalidArgument(f"{source}: layer={layer!r}: give the block index it belongs to (an int >= 0) "
                                  f"or None")
        super().__init__(W_enc, b_enc, W_dec, b_dec, activation, k=k, threshold=threshold, subtract_b_dec=False,
                         topk_relu=topk_relu, hook=None if layer is None else f"layers.{layer}.{reads}", source=source)
        self.layer, self.reads, self.d_out = layer, reads, self.b_dec.shape[0]
        if W_skip is None:
            self.register_parameter("W_skip", None)
        elif not isinstance(W_skip, Tensor) or tuple(W_skip.shape) != (self.d_in, self.d_out):
            raise InvalidArgument(f"{source}: W_skip has shape {shape_of(W_skip)}, but W_enc [d_in={self.d_in}, ...] "
                                  f"and b_dec [d_out={self.d_out}] make it {[self.d_in, self.d_out]} (x @ W_skip)")
        else:
            self.W_skip = frozen(W_skip, self.W_enc.dtype)

    @classmethod
    def load(cls, path, layer: int | None = None, k: int | None = None, hook: str | None = None, *,
             sae_id: str | None = None, revision: str | None = None) -> Transcoder:
        """The transcoder stored at ``path``: circuit-tracer's per-layer transcoders (a set's folder with
        ``config.yaml`` and ``layer_{i}.safetensors``, or one such file) or a SAELens 6 transcoder
        (``cfg.json`` + ``sae_weights.safetensors``; a folder of ``layer_{i}`` folders of them). ``path``
        is a local file or folder, or a Hugging Face Hub repository id (``"org/repo"``, at ``revision``:
        ``hub.py`` fetches the layer's files only), ``sae_id`` the set's folder in it (``SAE.load``'s name
        for it: SAELens's; circuit-tracer's subfolder). ``layer`` picks
        one of a set (and must agree with the transcoder's own where the format says it); ``k`` overrides
        (or supplies) a TopK transcoder's k. ``hook`` is ``SAE.load``'s: a transcoder reads its block's
        ``reads``, so it takes none."""
        if hook is not None:
            raise InvalidArgument(f"Transcoder.load(hook={hook!r}): a transcoder reads the value its record names at "
                                  f"its layer; pick the layer with layer=, or load an SAE with SAE.load(hook=)")
        from .hub import local  # lazy: keeps huggingface_hub out until a dictionary is loaded
        return cls(**read(local(path, "transcoder", sae_id, revision, layer, "sae_id"), layer=layer, k=k))

    @property
    def writes(self) -> str:
        """The value of its block it writes: ``mlp.mlp_output``."""
        return WRITES

    def skip(self, x: Tensor) -> Tensor:
        """The linear skip path ``x @ W_skip`` ``[..., d_out]`` in ``x``'s dtype; zeros without ``W_skip``."""
        if self.W_skip is None:
            return x.new_zeros(*x.shape[:-1], self.d_out)
        return (x.to(self.W_skip.dtype) @ self.W_skip).to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        """What the transcoder makes of the MLP input ``x``: ``decode(encode(x)) + skip(x)`` ``[..., d_out]``."""
        output = self.decode(self.encode(x))
        return output if self.W_skip is None else output + self.skip(x)

    def check_fits(self, hidden_size: int, name: str) -> None:
        """A ValueError unless it reads and writes vectors of the model's width (``hidden_size``)."""
        if (self.d_in, self.d_out) != (hidden_size, hidden_size):
            raise InvalidArgument(f"{self.source} reads vectors of d_in={self.d_in} and writes d_out={self.d_out}, but "
                                  f"'{name}' has hidden_size {hidden_size}: load the transcoder trained on this model")

    def extra_repr(self) -> str:
        """The transcoder's widths, skip, layer and what it reads, for its repr."""
        return (f"{super().extra_repr()}, d_out={self.d_out}, skip={self.W_skip is not None}, layer={self.layer}, "
                f"reads={self.reads!r}")
