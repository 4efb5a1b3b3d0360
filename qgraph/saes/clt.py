"""One record for a cross-layer transcoder (CLT): a feature of block i reads that block's MLP input
and writes the MLP outputs of blocks i, i+1, ..., n-1.

The conventions (every format, ``clt_formats.py``, is converted to them on loading), per block i of n:

    W_enc[i] [d_model, d_transcoder]          x @ W_enc[i], as qgraph keeps encoders (circuit-tracer
                                              stores [d_transcoder, d_model] and reads x @ W.T)
    b_enc[i] [d_transcoder]   b_dec[i] [d_model]   threshold[i] [d_transcoder] (JumpReLU, or none)
    W_dec[i] [d_transcoder, n - i, d_model]   W_dec[i][:, j - i] writes block j >= i
    W_skip[i] [d_model, d_model] (or none)    x @ W_skip[i] (Gemma Scope 2's affine skip connection)

    pre_i      = x_i @ W_enc[i] + b_enc[i]
    features_i = relu(pre_i)                              without thresholds
               = pre_i * (pre_i > threshold[i])           JumpReLU, as circuit-tracer's (not relu'd:
                                                          a negative threshold lets negatives through)
    decode_to(j, features) = sum over i <= j of features_i @ W_dec[i][:, j - i] + b_dec[j]
    reconstruction_j       = decode_to(j, features) + x_j @ W_skip[j]       block j's MLP output

b_dec[j] is added once, to block j's reconstruction (circuit-tracer's ``compute_reconstruction``).
``reads`` is the value of each block it reads: ``mlp_input`` (the output of the MLP's norm:
circuit-tracer's ``mlp.hook_in`` / ``ln2.hook_normalized``) or ``layer_mid`` (``hook_resid_mid``).
Splice one with ``qgraph.instrument(model, transcoders=clt)`` (``rewrites.clt.SpliceCLT``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import InvalidArgument, OutOfRange
from .sae import shape_of
from .transcoder_formats import READS, WRITES


class CrossLayerTranscoder(torch.nn.Module):
    """A cross-layer transcoder over ``n_layers`` blocks of a ``d_model``-wide model, ``d_transcoder``
    features per block. Load one with ``CrossLayerTranscoder.load(path)``; its weights are frozen
    parameters, one list per field, indexed by block (``clt.W_dec[i]``)."""

    decodes_input = False  # it reads MLP inputs and writes MLP outputs (qgraph.instrument(saes=) refuses it)
    k = None  # no TopK CLTs (the per-layer splice's sparse form is a TopK transcoder's)
    # one frozen parameter per block, set in __init__; threshold and W_skip None where the CLT has none
    W_enc: torch.nn.ParameterList
    b_enc: torch.nn.ParameterList
    W_dec: torch.nn.ParameterList
    b_dec: torch.nn.ParameterList
    threshold: torch.nn.ParameterList | None
    W_skip: torch.nn.ParameterList | None

    def __init__(self, W_enc: Sequence[Tensor], b_enc: Sequence[Tensor], W_dec: Sequence[Tensor],
                 b_dec: Sequence[Tensor], threshold: Sequence[Tensor] | None = None,
                 W_skip: Sequence[Tensor] | None = None, reads: str = "mlp_input",
                 source: str = "a cross-layer transcoder made in memory", dtype: torch.dtype | None = None):
        super().__init__()
        self.source = source
        if reads not in READS:
            raise InvalidArgument(f"{source}: reads={reads!r}: a cross-layer transcoder reads one of {READS} of "
                                  f"each block")
        fields = {"W_enc": W_enc, "b_enc": b_enc, "W_dec": W_dec, "b_dec": b_dec}
        fields.update({name: value for name, value in (("threshold", threshold), ("W_skip", W_skip))
                       if value is not None})
        for name, value in fields.items():
            if isinstance(value, Tensor) or not isinstance(value, Sequence) or not value:
                raise InvalidArgument(f"{source}: {name} should be a list of tensors, one per block, not "
                                      f"{type(value).__name__}" + (" (an empty list)" if value == [] else ""))
        n = len(W_enc)
        first = W_enc[0]
        if not isinstance(first, Tensor) or first.dim() != 2:
            raise InvalidArgument(f"{source}: W_enc[0] should be a [d_model, d_transcoder] tensor, not "
                                  f"{shape_of(first)}")
        d_model, d_transcoder = first.shape
        dims = {"W_enc": lambda i: (d_model, d_transcoder), "b_enc": lambda i: (d_transcoder,),
                "W_dec": lambda i: (d_transcoder, n - i, d_model), "b_dec": lambda i: (d_model,),
                "threshold": lambda i: (d_transcoder,), "W_skip": lambda i: (d_model, d_model)}
        for name, value in fields.items():
            if len(value) != n:
                raise InvalidArgument(f"{source}: {name} has {len(value)} blocks but W_enc has {n}: give every "
                                      f"field one tensor per block")
            for i, tensor in enumerate(value):
                shape = dims[name](i)
                if not isinstance(tensor, Tensor) or tuple(tensor.shape) != shape:
                    raise InvalidArgument(f"{source}: {name}[{i}] has shape {shape_of(tensor)}, expected {list(shape)} "
                                          f"(d_model={d_model}, d_transcoder={d_transcoder} from W_enc[0] "
                                          f"[d_model, d_transcoder], {n} blocks)")
                if not tensor.is_floating_point():
                    raise InvalidArgument(f"{source}: {name}[{i}] is {tensor.dtype}, not a floating-point tensor")
        dtype = dtype or first.dtype
        self.n_layers, self.d_model, self.d_transcoder, self.reads = n, d_model, d_transcoder, reads
        self.activation = "jumprelu" if threshold is not None else "relu"
        for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip"):
            if name in fields:
                setattr(self, name, torch.nn.ParameterList(
                    [torch.nn.Parameter(t.detach().to(dtype), requires_grad=False) for t in fields[name]]))
            else:
                setattr(self, name, None)

    @classmethod
    def load(cls, path, dtype: torch.dtype | None = None, reads: str | None = None, *, subfolder: str | None = None,
             revision: str | None = None) -> CrossLayerTranscoder:
        """The CLT stored in the folder ``path``: circuit-tracer's (``W_enc_{i}.safetensors`` and
        ``W_dec_{i}.safetensors``, an optional ``config.yaml`` beside) or Gemma Scope 2's
        (``params_layer_{i}.safetensors``); see ``clt_formats.py``. ``path`` is a local folder, or a Hugging
        Face Hub repository id (``"org/repo"``, at ``revision``; ``hub.py``), ``subfolder`` the CLT's folder
        in it. ``dtype`` casts the weights (the files' own dtype by default); ``reads`` overrides the value
        it reads where no config says."""
        from .clt_formats import read  # lazy: keeps transformers out until this is used
        from .hub import local  # lazy: keeps huggingface_hub out until a dictionary is loaded
        return cls(**read(local(path, "cross-layer transcoder", subfolder, revision), dtype=dtype, reads=reads))

    # the widths a block's splice checks (as a per-layer Transcoder's)
    @property
    def d_in(self) -> int:
        """The width a block's splice reads: the model's hidden size."""
        return self.d_model

    @property
    def d_out(self) -> int:
        """The width it writes: the model's hidden size."""
        return self.d_model

    @property
    def d_sae(self) -> int:
        """The number of features per layer."""
        return self.d_transcoder

    @property
    def writes(self) -> str:
        """The value of each block it writes: ``mlp.mlp_output``."""
        return WRITES

    def _block(self, i, what: str = "block") -> int:
        if not isinstance(i, int) or isinstance(i, bool) or not -self.n_layers <= i < self.n_layers:
            raise OutOfRange(f"{what} {i!r}: {self.source} has blocks 0 to {self.n_layers - 1}")
        return i % self.n_layers

    def _check_input(self, x, width: int, what: str) -> None:
        if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[-1] != width:
            raise InvalidArgument(f"{self.source}: {what} should be [..., {width}], not {shape_of(x)}")

    def pre(self, i: int, x: Tensor) -> Tensor:
        """Block ``i``'s pre-activations ``x @ W_enc[i] + b_enc[i]`` ``[..., d_transcoder]``, in the CLT's dtype."""
        i = self._block(i)
        self._check_input(x, self.d_model, f"block {i}'s input")
        return x.to(self.W_enc[i].dtype) @ self.W_enc[i] + self.b_enc[i]

    def encode(self, i: int, x: Tensor) -> Tensor:
        """Block ``i``'s features ``[..., d_transcoder]`` of its input ``x`` ``[..., d_model]``, in ``x``'s dtype."""
        i = self._block(i)
        pre = self.pre(i, x)
        if self.threshold is None:
            return torch.relu(pre).to(x.dtype)
        return (pre * (pre > self.threshold[i]).to(pre.dtype)).to(x.dtype)

    def decode_to(self, j: int, features_by_block: Sequence[Tensor]) -> Tensor:
        """What the features of blocks ``0..j`` (``features_by_block[i]``, ``[..., d_transcoder]``; more
        entries are ignored) write to block ``j``'s MLP output: ``sum_i features_i @ W_dec[i][:, j - i] +
        b_dec[j]``, ``[..., d_model]`` in the features' dtype."""
        j = self._block(j)
        if isinstance(features_by_block, Tensor) or len(features_by_block) < j + 1:
            given = "a tensor" if isinstance(features_by_block, Tensor) else f"{len(features_by_block)}"
            raise InvalidArgument(f"{self.source}: decode_to({j}, ...) reads the features of blocks 0 to {j}, one "
                                  f"tensor each in a list; {given} given")
        out = self._written(0, j, features_by_block[0])
        for i in range(1, j + 1):
            out = out + self._written(i, j, features_by_block[i])
        return (out + self.b_dec[j]).to(features_by_block[0].dtype)

    def _written(self, i: int, j: int, features: Tensor) -> Tensor:
        """What block ``i``'s ``features`` write to block ``j``: ``features @ W_dec[i][:, j - i]``."""
        self._check_input(features, self.d_transcoder, f"block {i}'s features")
        return features.to(self.W_dec[i].dtype) @ self.W_dec[i][:, j - i]

    def skip(self, i: int, x: Tensor) -> Tensor:
        """Block ``i``'s skip path ``x @ W_skip[i]`` ``[..., d_model]`` in ``x``'s dtype; zeros without one."""
        i = self._block(i)
        self._check_input(x, self.d_model, f"block {i}'s input")
        if self.W_skip is None:
            return x.new_zeros(x.shape)
        return (x.to(self.W_skip[i].dtype) @ self.W_skip[i]).to(x.dtype)

    def forward(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        """Every block's reconstruction of its MLP output from ``inputs`` (one tensor per block, what
        each reads): ``decode_to(j, features) + skip(j, inputs[j])``."""
        if isinstance(inputs, Tensor) or len(inputs) != self.n_layers:
            raise InvalidArgument(f"{self.source}: forward reads {self.n_layers} inputs, one per block")
        features = [self.encode(i, x) for i, x in enumerate(inputs)]
        return [self.decode_to(j, features) + self.skip(j, inputs[j]) for j in range(self.n_layers)]

    def block(self, i: int) -> CLTBlock:
        """Block ``i`` of it, as the splice checks a block's transcoder (its widths, what it reads)."""
        return CLTBlock(self, self._block(i))

    def __repr__(self) -> str:
        skip = ", skip" if self.W_skip is not None else ""
        return (f"CrossLayerTranscoder({self.n_layers} blocks, {self.d_transcoder} features, {self.activation}, "
                f"reads {self.reads}{skip})")


class CLTBlock:
    """One block of a cross-layer transcoder: what ``check_transcoders`` and the catalogue read of a
    block's transcoder (``layer``, ``reads``, ``writes``, the widths, ``source``)."""

    def __init__(self, clt: CrossLayerTranscoder, layer: int):
        self.clt, self.layer = clt, layer
        self.reads, self.writes, self.k, self.activation = clt.reads, clt.writes, None, clt.activation
        self.d_in, self.d_out, self.d_sae = clt.d_model, clt.d_model, clt.d_transcoder
        self.source = f"block {layer} of {clt.source}"

    def __repr__(self) -> str:
        return f"CLTBlock({self.layer} of {self.clt!r})"
