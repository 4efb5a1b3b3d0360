"""What the user passes -> what the exported program takes, with errors that say what is wrong.

A text program takes ``input_ids`` and ``attention_mask``. The image-text program also takes the
tensors its family's ``Images.prepare`` computes from the processor's outputs.

Every input is checked first, cheaply (a min and max over the ids, a pass over the mask): ids in
the vocabulary, no empty prompt, a 0/1 mask of the ids' shape with a token in every row, image
inputs that agree with each other and the prompt. Lists and arrays are converted to tensors.
"""
from __future__ import annotations

import torch

from .errors import InvalidArgument, InvalidType


# Keyword arguments of a Hugging Face forward that an instrumented call does not take, and what to do instead
_INSTEAD = {
    "output_hidden_states": "ask for values=['layers.*.layer_output'] instead",
    "output_attentions": "ask for values=['layers.*.*.attention_probabilities'] (eager load) instead",
    "labels": "compute the loss from out.logits instead",
    "past_key_values": "use ig.generate(...) to decode from a cache",
    "use_cache": "use ig.generate(...) to decode from a cache",
    "position_ids": "positions follow the attention_mask (left padding is handled)",
    "inputs_embeds": "edit 'layers.0.layer_input' instead (ig(ids, edits={'layers.0.layer_input': Replace(x)}))",
}


def prepare(model, images, input_ids=None, attention_mask=None, *, with_images: bool = False, **inputs) -> dict:
    """The program inputs for one call, checked: a bad input raises a TypeError or ValueError that
    says what is wrong and what to pass instead. ``images`` is the family's ``Images`` (None for a
    family without); ``with_images`` picks the image-text program, whose extra inputs
    ``images.prepare`` computes from the processor's outputs (a text program ignores them)."""
    keys = images.keys if images is not None else ()
    unexpected = [name for name in inputs if name not in keys]
    if unexpected:
        hints = "".join(f"; {name}: {_INSTEAD[name]}" for name in sorted(unexpected) if name in _INSTEAD)
        image_inputs = "".join(", " + key for key in keys) if with_images else ""
        raise InvalidType(f"unexpected inputs {sorted(unexpected)}: an instrumented model takes input_ids, "
                          f"attention_mask{image_inputs} and edits{hints}")
    input_ids, attention_mask = _text(model, input_ids, attention_mask)
    prepared = {"input_ids": input_ids, "attention_mask": attention_mask}
    if with_images:
        prepared.update(images.prepare(model, input_ids, attention_mask, **inputs))
    return prepared


def vision_given(inputs: dict) -> bool:
    """Whether a call brings images or videos (their pixels); a grid without its pixels is refused."""
    for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if inputs.get(pixels) is None and inputs.get(grid) is not None:
            raise InvalidArgument(f"{grid} came without {pixels}: pass both, as the processor returns them")
    return inputs.get("pixel_values") is not None or inputs.get("pixel_values_videos") is not None


def image_keys(family) -> tuple[str, ...]:
    """What a call to a model of ``family`` takes beyond the text (the processor's image outputs)."""
    return family.images.keys if family.images is not None else ()


def input_embedding(model) -> torch.nn.Embedding:
    """The model's input embedding: an ``nn.Embedding`` in every family qgraph knows (transformers'
    ``get_input_embeddings`` promises only an ``nn.Module``)."""
    return model.get_input_embeddings()


def _text(model, input_ids, attention_mask):
    embedding = input_embedding(model)
    return check_text(input_ids, attention_mask, embedding.num_embeddings, embedding.weight.device)


def check_text(input_ids, attention_mask, rows: int, device: torch.device):
    """``(input_ids, attention_mask)`` checked for an embedding of ``rows`` rows on ``device``."""
    input_ids = _ids(input_ids)
    _check_device(device, input_ids)
    _check_vocabulary(rows, input_ids)
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids)
    return input_ids, _mask(attention_mask, input_ids)


def _ids(input_ids) -> torch.Tensor:
    """``input_ids`` as a LongTensor [batch, seq] with at least one token (lists and arrays are converted)."""
    if input_ids is None:
        raise InvalidType("input_ids is required: a LongTensor [batch, seq] "
                          "(e.g. ig(**tokenizer(text, return_tensors='pt')))")
    if isinstance(input_ids, str):
        raise InvalidType(f"input_ids is the text {input_ids[:40]!r}: tokenize it first, "
                          f"ig(**tokenizer(text, return_tensors='pt'))")
    input_ids = as_tensor(input_ids, "input_ids")
    if input_ids.dim() == 1:
        raise InvalidArgument(f"input_ids has shape {tuple(input_ids.shape)}; it must be [batch, seq]: "
                              f"add the batch dim with input_ids[None]")
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise InvalidArgument(f"input_ids must be an integer tensor [batch, seq], got {input_ids.dtype} "
                              f"{tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise InvalidArgument(f"input_ids has shape {tuple(input_ids.shape)}: an empty prompt; give at least one "
                              f"prompt of at least one token (an empty text tokenizes to nothing: add text or the "
                              f"chat template)")
    return input_ids.long()


def _check_device(device: torch.device, input_ids: torch.Tensor) -> None:
    """input_ids must be where the embedding is (a model on meta, not loaded yet, is not checked)."""
    if input_ids.device != device and device.type != "meta":
        raise InvalidArgument(f"input_ids is on {input_ids.device} but the model's embedding is on {device}: pass "
                              f"input_ids.to('{device}') (and the attention_mask too)")


def _check_vocabulary(rows: int, input_ids: torch.Tensor) -> None:
    """Every id must index a row of the model's embedding (one min and max over the ids)."""
    low, high = (int(v) for v in torch.aminmax(input_ids))
    if low < 0 or high >= rows:
        bad = low if low < 0 else high
        raise InvalidArgument(f"input_ids hold {bad}, outside the vocabulary: the model's embedding has {rows} rows "
                              f"(ids 0 to {rows - 1}). Tokenize with this model's tokenizer (and replace any -100 or "
                              f"-1 padding ids with its pad_token_id)")


def _mask(attention_mask, input_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask as a LongTensor of 0/1 of input_ids' shape, every row with a token."""
    attention_mask = as_tensor(attention_mask, "attention_mask")
    if attention_mask.device != input_ids.device:
        raise InvalidArgument(f"attention_mask is on {attention_mask.device} but input_ids is on {input_ids.device}: "
                              f"pass both on the model's device")
    if attention_mask.shape != input_ids.shape:
        raise InvalidArgument(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                              f"{tuple(input_ids.shape)}; they must match (a [batch, seq] mask of 1 for tokens, "
                              f"0 for padding, as the tokenizer returns it)")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise InvalidType(f"attention_mask is {attention_mask.dtype}; it must be bool or integer 1 (token) / 0 "
                          f"(padding), as the tokenizer returns it: pass attention_mask.long() if it holds 0/1 "
                          f"(an additive mask of 0/-inf is not taken)")
    if attention_mask.dtype != torch.bool:
        stray = (attention_mask != 0) & (attention_mask != 1)
        if bool(stray.any()):
            found = sorted(set(attention_mask[stray].unique()[:5].tolist()))
            raise InvalidArgument(f"attention_mask holds {found}; it must hold only 1 (token) and 0 (padding)")
    empty = ~attention_mask.bool().any(-1)
    if bool(empty.any()):
        rows = empty.nonzero().flatten().tolist()
        raise InvalidArgument(f"attention_mask rows {rows} are all padding: those prompts hold no token, and a model's "
                              f"output for them is meaningless (Hugging Face returns arbitrary finite values). Drop "
                              f"those rows, or give each at least one token")
    return attention_mask.long()


_PAD = "pad them (tokenizer(texts, padding=True, return_tensors='pt')) and pass the attention_mask"


def as_tensor(data, what: str, ragged: str = _PAD) -> torch.Tensor:
    """A tensor from a tensor, a nested list or an array; a named error for anything else (``ragged``
    says what to do about rows of different lengths)."""
    if isinstance(data, torch.Tensor):
        return data
    try:
        return torch.as_tensor(data)
    except (TypeError, ValueError, RuntimeError) as error:
        if isinstance(data, (list, tuple)) and "sequence" in str(error):
            raise InvalidArgument(f"{what}: its rows have different lengths: {ragged}") from None
        raise InvalidType(f"{what}: {type(data).__name__} is not a tensor of integers") from None
