"""Generation with captures and edits at every step, decoding from an explicit cache.

``ig.generate(input_ids, max_new_tokens=N, ...)`` runs two programs built from the text program by
``passes.decode.open_cache``: the *prompt* program (the prompt in one pass, chunked delta rule) and the
*decode* program (one token, the token-by-token delta rule). Both take the cache as inputs and
return its successor as outputs: each attention block's keys and values (``[batch, kv_heads, past,
head_dim]``, after the rotary), each DeltaNet block's recurrent state and conv context. Positions
and the attention mask follow HF ``generate``: positions are ``cumsum(attention_mask) - 1`` (so
left padding is skipped), the mask grows by a column of ones per step.

``out.steps[0]`` holds the values of the prompt pass; ``out.steps[k]`` (k >= 1) those of the pass
that reads the k-th new token (a one-token pass: sequence axes have length 1, attention patterns
are ``[batch, heads, 1, past + 1]``). The last new token is also run through, so there is one entry
per new token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from . import derive
from .export import export_model
from .inputs import IMAGE_KEYS, prepare
from .names import canonical
from .passes import Found, OnRequest
from .passes.decode import cache_names, open_cache
from .program import Program


class Step(dict):
    """One step's captured values, ``{name: tensor}``; also takes the spellings ``values=`` takes."""

    def __init__(self, values: dict, logits: torch.Tensor, blocks: int):
        super().__init__(values)
        self.logits, self._blocks = logits, blocks

    def __getitem__(self, name):
        key = canonical(name, self._blocks) if not dict.__contains__(self, name) else name
        if not dict.__contains__(self, key):
            raise KeyError(f"'{name}' was not captured; captured: {', '.join(self) or 'nothing'}")
        return dict.__getitem__(self, key)

    def __contains__(self, name):
        return dict.__contains__(self, name) or dict.__contains__(self, canonical(name, self._blocks))


@dataclass
class GenerateOutput:
    """What ``ig.generate`` returns.

    ``sequences``: the prompt and the new tokens ``[batch, prompt + new]`` (rows that stopped are
    filled with the pad id, as HF does). ``steps``: one ``Step`` per pass (0: the prompt, k: the
    pass over new token k). ``scores``: the processed next-token scores that chose each new token
    ``[batch, vocab]``. ``logits``: each pass's raw logits at its last position ``[batch, vocab]``.
    """

    sequences: torch.Tensor
    steps: list[Step] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    def stacked(self, name: str, position: int = -1) -> torch.Tensor:
        """A value over the decode steps, stacked on a new axis 1: each step's ``[:, position]``
        along its sequence axis (axis 1), the prompt pass included at its last position."""
        return torch.stack([step[name][:, position] for step in self.steps], dim=1)


def chat_prompt(tokenizer, messages, *, enable_thinking: bool, add_generation_prompt: bool = True,
                tokenize: bool = True, **kwargs):
    """The chat template applied to ``messages`` (one conversation, or a list of them), with
    ``enable_thinking`` passed through to ``apply_chat_template``. The flag is required: the Qwen3.5
    templates differ by size in what they default to (0.8B and 2B close the think block unless
    ``enable_thinking=True``; 4B and up open it unless ``enable_thinking=False``).

    Returns the tokenizer's output (``input_ids``, ``attention_mask``; left-padded for a batch),
    ready for ``ig(**...)`` or ``ig.generate(**...)``, or the text with ``tokenize=False``.
    """
    if not isinstance(enable_thinking, bool):
        raise TypeError("enable_thinking must be True or False: the templates' defaults differ by model size")
    batch = bool(messages) and isinstance(messages[0], (list, tuple))
    conversations = messages if batch else [messages]
    texts = [tokenizer.apply_chat_template(list(conversation), tokenize=False, enable_thinking=enable_thinking,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
             for conversation in conversations]
    if not tokenize:
        return texts if batch else texts[0]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # generation continues every row at its end
    try:
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side


class Decoder:
    """The prompt and decode programs of one instrumented model and one set of values."""

    def __init__(self, ig, values: list[str], options: dict):
        exported = export_model(ig.model, images=False)
        self.ig = ig
        self.hosts = None
        self.prompt = self._build(ig, exported, values, options, recurrent=False)
        self.decode = self._build(ig, exported, values, options, recurrent=True)
        self.values = [name for name in values if name in self.present]

    def _build(self, ig, exported, values, options, recurrent) -> Program:
        program = Program(ig.model, exported)
        present = {name for name, entry in program.catalogue.items() if isinstance(entry.location, (Found, OnRequest))}
        present |= {name for name, entry in program.catalogue.items()
                    if entry.derived and set(Program.sources_of(entry)) <= present}
        self.present = present
        self.hosts = cache_names(program)
        return program.build([name for name in values if name in present],
                             {name: slot for name, slot in ig.slots.items() if name in present}, True,
                             {name: option for name, option in options.items() if name in present},
                             rewrite=partial(open_cache, recurrent=recurrent))

    def empty_cache(self, batch: int) -> dict[str, torch.Tensor]:
        config = self.ig.model.config.get_text_config()
        parameter = next(self.ig.model.parameters())
        dtype, device = parameter.dtype, parameter.device
        cache = {}
        for host in self.hosts["self_attn"]:
            for part in ("keys", "values"):
                cache[f"{host}.{part}"] = torch.zeros(batch, config.num_key_value_heads, 0, config.head_dim,
                                                      dtype=dtype, device=device)
        conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim \
            + config.linear_num_value_heads * config.linear_value_head_dim
        for host in self.hosts["linear_attn"]:
            cache[f"{host}.state"] = torch.zeros(batch, config.linear_num_value_heads, config.linear_key_head_dim,
                                                 config.linear_value_head_dim, dtype=torch.float32, device=device)
            cache[f"{host}.conv"] = torch.zeros(batch, conv_dim, config.linear_conv_kernel_dim - 1, dtype=dtype,
                                                device=device)
        return cache

    def next_cache(self, captured: dict) -> dict[str, torch.Tensor]:
        cache = {}
        for host in self.hosts["self_attn"]:
            for part in ("keys", "values"):
                cache[f"{host}.{part}"] = captured.pop(f"{host}.cache_{part}")
        for host in self.hosts["linear_attn"]:
            cache[f"{host}.state"] = captured.pop(f"{host}.cache_state")
            cache[f"{host}.conv"] = captured.pop(f"{host}.cache_conv")
        return cache


def causal_mask(full_mask: torch.Tensor, new: int) -> torch.Tensor:
    """``[batch, 1, new, past + new]``: key j is seen by new token i when it is not padding and
    ``j <= past + i``."""
    length = full_mask.shape[1]
    past = length - new
    keys = torch.arange(length, device=full_mask.device)
    queries = torch.arange(new, device=full_mask.device) + past
    causal = keys[None, :] <= queries[:, None]
    return (causal[None, None] & full_mask.bool()[:, None, None, :])


def _selected(steps, step: int, total_hint: int) -> bool:
    if steps is None:
        return True
    if isinstance(steps, slice):
        return step in range(total_hint)[steps]
    if isinstance(steps, int):
        return step == steps
    return step in set(steps)


def _processors(model, generation_kwargs: dict, prompt_ids: torch.Tensor):
    """HF's own logits processors for these settings (temperature, top_k, top_p, repetition
    penalty, ...), and the generation config they come from."""
    from transformers.generation.logits_process import LogitsProcessorList
    config, _ = model._prepare_generation_config(None, **generation_kwargs)
    processors = model._get_logits_processor(config, input_ids_seq_length=prompt_ids.shape[1],
                                             encoder_input_ids=prompt_ids, logits_processor=LogitsProcessorList(),
                                             device=prompt_ids.device, model_kwargs={})
    return processors, config


def generate(ig, input_ids=None, attention_mask=None, *, max_new_tokens: int = 20, values=None, edits=None,
             steps=None, do_sample: bool = False, temperature=None, top_k=None, top_p=None, eos_token_id=None,
             pad_token_id=None, generator: torch.Generator | None = None, seed: int | None = None,
             **generation_kwargs) -> GenerateOutput:
    """See ``InstrumentedModel.generate``."""
    if any(generation_kwargs.get(key) is not None for key in IMAGE_KEYS):
        raise NotImplementedError("generate with images is not supported yet: generate takes text only "
                                  "(input_ids, attention_mask); a text-only prompt works on the image-text model")
    for key in IMAGE_KEYS:
        generation_kwargs.pop(key, None)
    if generation_kwargs.get("num_beams", 1) not in (None, 1):
        raise NotImplementedError("beam search is not supported: generate decodes greedily or by sampling")
    model = ig.model
    prepared = prepare(model, False, input_ids, attention_mask)
    ids, mask = prepared["input_ids"], prepared["attention_mask"]
    if values is None:
        names, options = ig.values, ig.options
    else:
        names, options = ig._resolve(list(values)), ig._options(values)
    key = tuple(names)
    decoders = ig.__dict__.setdefault("_decoders", {})
    if key not in decoders:
        decoders[key] = Decoder(ig, names, options)
    decoder = decoders[key]

    settings = {"do_sample": do_sample, "max_new_tokens": max_new_tokens, **generation_kwargs}
    for name, setting in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                          ("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if setting is not None:
            settings[name] = setting
    processors, config = _processors(model, settings, ids)
    eos = config.eos_token_id
    if eos is None:
        eos = model.config.get_text_config().eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    eos_ids = torch.tensor(eos, dtype=torch.long, device=ids.device)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    if do_sample and generator is None and seed is not None:
        generator = torch.Generator(device=ids.device).manual_seed(seed)

    batch, prompt_length = ids.shape
    blocks = len(ig.family.block_mixers(ig.config))
    cache = decoder.empty_cache(batch)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    sequences, full_mask, new_ids = ids, mask, ids
    unfinished = torch.ones(batch, dtype=torch.bool, device=ids.device)
    output = GenerateOutput(sequences)
    edits = edits or {}
    step, last = 0, max_new_tokens == 0
    while True:
        new = new_ids.shape[1]
        inputs = {"input_ids": new_ids, "attention_mask": full_mask[:, -new:], "positions": positions[:, -new:],
                  "causal_mask": causal_mask(full_mask, new), **cache}
        program = decoder.prompt if step == 0 else decoder.decode
        active = ig._activate(edits) if edits and _selected(steps, step, max_new_tokens + 1) else []
        try:
            with torch.no_grad():
                logits, captured = program.run(inputs)
        finally:
            for slot in active:
                slot.edit = None
        cache = decoder.next_cache(captured)
        for name, entry in program.derived.items():
            how = getattr(derive, entry.spec.rule.how)
            captured[name] = how(*(captured[s] for s in program.sources_of(entry)), inputs=inputs, config=ig.config)
        output.steps.append(Step({name: captured[name] for name in decoder.values if name in captured},
                                 logits, blocks))
        output.logits.append(logits[:, -1])
        if last:
            break
        scores = processors(sequences, logits[:, -1].to(copy=True, dtype=torch.float32))
        output.scores.append(scores)
        if do_sample:
            probabilities = torch.softmax(scores, dim=-1)
            next_ids = torch.multinomial(probabilities, num_samples=1, generator=generator).squeeze(1)
        else:
            next_ids = scores.argmax(dim=-1)
        if len(eos):
            next_ids = torch.where(unfinished, next_ids, torch.full_like(next_ids, pad))
        sequences = torch.cat([sequences, next_ids[:, None]], dim=1)
        full_mask = torch.cat([full_mask, full_mask.new_ones(batch, 1)], dim=1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
        if len(eos):
            unfinished &= ~torch.isin(next_ids, eos_ids)
        new_ids = next_ids[:, None]
        step += 1
        last = step == max_new_tokens or not bool(unfinished.any())
    output.sequences = sequences
    return output
