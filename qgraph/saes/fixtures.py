"""Tiny random SAEs written in each format, for tests: ``write_qwen_scope``, ``write_saelens``,
``write_sparsify`` (per-layer transcoders, circuit-tracer's and SAELens's: ``write_transcoders``;
cross-layer transcoders, circuit-tracer's and Gemma Scope 2's: ``tiny_clt``).
With the same ``seed`` (and sizes) they hold the same weights, each in its own layout, so they load
to the same record tensor for tensor; what differs is each format's conventions (Qwen-Scope does not
subtract b_dec and keeps raw top-k values; SAELens and sparsify subtract b_dec and relu them)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import InvalidArgument


def weights(d_in: int, d_sae: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The record's weights of a seed: ``W_enc [d_in, d_sae]``, ``b_enc``, ``W_dec [d_sae, d_in]``,
    ``b_dec``, and a positive JumpReLU ``threshold``, float32."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape, scale):
        return torch.randn(*shape, generator=generator) * scale

    return {"W_enc": normal(d_in, d_sae, scale=d_in ** -0.5), "b_enc": normal(d_sae, scale=0.1),
            "W_dec": normal(d_sae, d_in, scale=d_sae ** -0.5), "b_dec": normal(d_in, scale=0.1),
            "threshold": torch.rand(d_sae, generator=generator) * 0.5}


def write_qwen_scope(dir, layer: int, d_in: int, d_sae: int, seed: int = 0, k: int | None = None) -> Path:
    """``layer{layer}.sae.pt`` as Qwen-Scope ships it (``W_enc [d_sae, d_in]``, ``W_dec [d_in, d_sae]``),
    in ``dir`` or, given ``k``, in ``dir/SAE-Res-Tiny-W{d_sae}-L0_{k}`` (k is read from that name).
    Returns the folder; load it with ``SAE.load(folder, layer=layer)``."""
    folder = Path(dir) / f"SAE-Res-Tiny-W{d_sae}-L0_{k}" if k is not None else Path(dir)
    folder.mkdir(parents=True, exist_ok=True)
    w = weights(d_in, d_sae, seed)
    torch.save({"W_enc": w["W_enc"].T.contiguous(), "b_enc": w["b_enc"], "W_dec": w["W_dec"].T.contiguous(),
                "b_dec": w["b_dec"]}, folder / f"layer{layer}.sae.pt")
    return folder


def write_saelens(dir, d_in: int, d_sae: int, architecture: str = "topk", k: int | None = None,
                  hook_name: str = "blocks.0.hook_resid_post", seed: int = 0) -> Path:
    """``cfg.json`` + ``sae_weights.safetensors`` as SAELens 6 saves them (``apply_b_dec_to_input``,
    the hook name under ``metadata``); ``architecture`` "topk" (needs ``k``), "jumprelu" or "standard".
    Returns the folder."""
    from safetensors.torch import save_file
    if (architecture == "topk") != (k is not None):
        raise InvalidArgument(f"write_saelens: k={k!r} with architecture={architecture!r}: give k for topk only")
    folder = Path(dir)
    folder.mkdir(parents=True, exist_ok=True)
    w = weights(d_in, d_sae, seed)
    keep = ["W_enc", "b_enc", "W_dec", "b_dec"] + (["threshold"] if architecture == "jumprelu" else [])
    save_file({name: w[name].contiguous() for name in keep}, str(folder / "sae_weights.safetensors"))
    cfg = {"architecture": architecture, "d_in": d_in, "d_sae": d_sae, "dtype": "float32", "device": "cpu",
           "apply_b_dec_to_input": True, "normalize_activations": "none", "reshape_activations": "none",
           "metadata": {"hook_name": hook_name, "model_name": "tiny", "sae_lens_version": "6.0.0"}}
    if k is not None:
        cfg["k"] = k
    (folder / "cfg.json").write_text(json.dumps(cfg, indent=2))
    return folder


def write_sparsify(dir, d_in: int, d_sae: int, k: int, seed: int = 0, layer: int | None = None) -> Path:
    """``cfg.json`` + ``sae.safetensors`` as sparsify saves them (``encoder.weight [d_sae, d_in]``), in
    ``dir`` or, given ``layer``, in ``dir/layers.{layer}`` (sparsify's folder of a block's output).
    Returns the SAE's folder."""
    from safetensors.torch import save_file
    folder = Path(dir) / f"layers.{layer}" if layer is not None else Path(dir)
    folder.mkdir(parents=True, exist_ok=True)
    w = weights(d_in, d_sae, seed)
    save_file({"encoder.weight": w["W_enc"].T.contiguous(), "encoder.bias": w["b_enc"], "W_dec": w["W_dec"],
               "b_dec": w["b_dec"]}, str(folder / "sae.safetensors"))
    cfg = {"activation": "topk", "expansion_factor": d_sae // d_in, "normalize_decoder": True,
           "num_latents": d_sae, "k": k, "multi_topk": False, "skip_connection": False, "transcode": False,
           "d_in": d_in}
    (folder / "cfg.json").write_text(json.dumps(cfg, indent=2))
    return folder


def write_transcoders(dir, d_model: int, layers, d_transcoder: int, *, format: str = "circuit-tracer",
                      activation: str = "relu", skip: bool = False, seed: int = 0, k: int | None = None,
                      model_name: str = "tiny") -> Path:
    """Tiny random per-layer transcoders of the blocks ``layers`` (a count, or the block indices), as
    the library writes them, in ``dir``; returns ``dir``. Load one with ``Transcoder.load(dir, layer=i)``.

    * ``format="circuit-tracer"``: ``config.yaml`` (``model_kind: transcoder_set``, ``model_name``,
      ``feature_input_hook: mlp.hook_in``, ``feature_output_hook: mlp.hook_out``; ``activation: topk``
      and ``k`` for TopK) and ``layer_{i}.safetensors`` as ``SingleLayerTranscoder.to_safetensors``
      saves them (``W_enc``/``W_dec [d_transcoder, d_model]``, ``b_enc``, ``b_dec``, optionally
      ``activation_function.threshold``, ``W_skip [d_model, d_model]`` and ``k``); activation "relu",
      "jumprelu" or "topk" (needs ``k``).
    * ``format="saelens"``: ``layer_{i}/cfg.json`` + ``sae_weights.safetensors`` as SAELens 6's
      ``save_model`` writes them (architecture ``transcoder``, ``skip_transcoder``,
      ``jumprelu_transcoder`` or ``jumprelu_skip_transcoder``; ``W_enc [d_in, d_sae]``, ``W_dec [d_sae,
      d_out]``, ``W_skip [d_out, d_in]``, the hooks under ``metadata``); activation "relu" or "jumprelu".

    Layer ``i`` of seed ``s`` holds the weights of ``weights(d_model, d_transcoder, s + 1000 * i)`` (and
    a small random skip), each format in its own layout: they load to the same record."""
    from safetensors.torch import save_file
    if format not in ("circuit-tracer", "saelens"):
        raise InvalidArgument(f"write_transcoders: format={format!r}: 'circuit-tracer' or 'saelens'")
    kinds = ("relu", "jumprelu", "topk") if format == "circuit-tracer" else ("relu", "jumprelu")
    if activation not in kinds or (activation == "topk") != (k is not None):
        raise InvalidArgument(f"write_transcoders: activation={activation!r}, k={k!r}: {format} writes {kinds} "
                              f"(k for topk only)")
    folder = Path(dir)
    folder.mkdir(parents=True, exist_ok=True)
    for i in (range(layers) if isinstance(layers, int) else layers):
        w = weights(d_model, d_transcoder, seed + 1000 * i)
        generator = torch.Generator().manual_seed(seed + 1000 * i + 1)
        # the record's [d_in, d_out]
        w_skip = torch.randn(d_model, d_model, generator=generator) * (0.1 * d_model ** -0.5)
        if format == "circuit-tracer":
            tensors = {"W_enc": w["W_enc"].T.contiguous(), "W_dec": w["W_dec"], "b_enc": w["b_enc"],
                       "b_dec": w["b_dec"]}
            if activation == "jumprelu":
                tensors["activation_function.threshold"] = w["threshold"]
            if activation == "topk":
                tensors["k"] = torch.tensor(k)
            if skip:
                tensors["W_skip"] = w_skip.T.contiguous()
            save_file(tensors, str(folder / f"layer_{i}.safetensors"))
            continue
        architecture = ("jumprelu_" if activation == "jumprelu" else "") + ("skip_transcoder" if skip else "transcoder")
        tensors = {name: w[name] for name in ("W_enc", "b_enc", "W_dec", "b_dec")}
        if activation == "jumprelu":
            tensors["threshold"] = w["threshold"]
        if skip:
            tensors["W_skip"] = w_skip.T.contiguous()
        (folder / f"layer_{i}").mkdir(exist_ok=True)
        save_file(tensors, str(folder / f"layer_{i}" / "sae_weights.safetensors"))
        cfg = {"d_in": d_model, "d_sae": d_transcoder, "dtype": "float32", "device": "cpu",
               "apply_b_dec_to_input": False, "normalize_activations": "none", "reshape_activations": "none",
               "metadata": {"sae_lens_version": "6.0.0", "sae_lens_training_version": "6.0.0",
                            "model_name": model_name, "hook_name": f"blocks.{i}.ln2.hook_normalized",
                            "hook_name_out": f"blocks.{i}.hook_mlp_out"},
               "d_out": d_model, "architecture": architecture}
        (folder / f"layer_{i}" / "cfg.json").write_text(json.dumps(cfg))
    if format == "circuit-tracer":
        config: dict[str, object] = {"model_kind": "transcoder_set", "model_name": model_name,
                                     "feature_input_hook": "mlp.hook_in", "feature_output_hook": "mlp.hook_out",
                                     "scan": f"{model_name}-transcoders"}
        if activation == "topk":
            config.update(activation="topk", k=k)
        import yaml
        (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder


def tiny_clt(dir, model_or_config, d_transcoder: int = 32, *, jumprelu: bool = False, reads: str = "mlp_input",
             seed: int = 0, format: str = "circuit-tracer", skip: bool = False) -> Path:
    """A tiny random cross-layer transcoder for the blocks of a model (or its config), written in
    ``dir`` as the library writes it; returns ``dir``. Load it with ``CrossLayerTranscoder.load(dir)``.

    * ``format="circuit-tracer"`` (``CrossLayerTranscoder.to_safetensors``'s files): ``W_enc_{i}.safetensors``
      (``W_enc_{i} [d_transcoder, d_model]``, ``b_enc_{i}``, ``b_dec_{i}``, with ``jumprelu`` ``threshold_{i}``)
      and ``W_dec_{i}.safetensors`` (``W_dec_{i} [d_transcoder, n - i, d_model]``); no skip path.
    * ``format="gemma-scope-2"``: ``params_layer_{i}.safetensors`` (``w_enc [d_model, d_transcoder]``,
      ``b_enc``, ``b_dec``, ``threshold``, ``w_dec [d_transcoder, n, d_model]`` zero before block i, with
      ``skip`` ``affine_skip_connection [d_model, d_model]``); always JumpReLU.

    With ``reads="layer_mid"`` a ``config.yaml`` beside names ``feature_input_hook: hook_resid_mid`` (and
    ``feature_output_hook: hook_mlp_out``); ``reads="mlp_input"`` writes none (the bare folder's default)."""
    from safetensors.torch import save_file
    config = getattr(model_or_config, "config", model_or_config)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    n, d_model = config.num_hidden_layers, config.hidden_size
    if format not in ("circuit-tracer", "gemma-scope-2"):
        raise InvalidArgument(f"tiny_clt: format={format!r}: 'circuit-tracer' or 'gemma-scope-2'")
    if reads not in ("mlp_input", "layer_mid"):
        raise InvalidArgument(f"tiny_clt: reads={reads!r}: 'mlp_input' or 'layer_mid'")
    if format == "circuit-tracer" and skip:
        raise InvalidArgument("tiny_clt: circuit-tracer's CLT files have no skip path: skip=True is Gemma Scope 2's")
    if format == "gemma-scope-2" and not jumprelu:
        raise InvalidArgument("tiny_clt: Gemma Scope 2's CLTs are JumpReLU: give jumprelu=True")
    folder = Path(dir)
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape, scale):
        return torch.randn(*shape, generator=generator) * scale

    for i in range(n):
        w_enc, b_enc = normal(d_model, d_transcoder, scale=d_model ** -0.5), normal(d_transcoder, scale=0.1)
        w_dec, b_dec = normal(d_transcoder, n - i, d_model, scale=d_transcoder ** -0.5), normal(d_model, scale=0.1)
        threshold = torch.rand(d_transcoder, generator=generator) * 0.5
        if format == "circuit-tracer":
            tensors = {f"W_enc_{i}": w_enc.T.contiguous(), f"b_enc_{i}": b_enc, f"b_dec_{i}": b_dec}
            if jumprelu:
                tensors[f"threshold_{i}"] = threshold
            save_file(tensors, str(folder / f"W_enc_{i}.safetensors"))
            save_file({f"W_dec_{i}": w_dec}, str(folder / f"W_dec_{i}.safetensors"))
            continue
        full = torch.cat([torch.zeros(d_transcoder, i, d_model), w_dec], dim=1)  # [d_transcoder, n, d_model]
        tensors = {"w_enc": w_enc, "b_enc": b_enc, "b_dec": b_dec, "threshold": threshold, "w_dec": full}
        if skip:
            tensors["affine_skip_connection"] = normal(d_model, d_model, scale=0.1 * d_model ** -0.5)
        save_file(tensors, str(folder / f"params_layer_{i}.safetensors"))
    if reads == "layer_mid":
        import yaml
        settings = {"model_kind": "cross_layer_transcoder", "feature_input_hook": "hook_resid_mid",
                    "feature_output_hook": "hook_mlp_out"}
        (folder / "config.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    return folder
