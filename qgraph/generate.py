"""Generation with captures and edits at every step, decoding from an explicit cache.

``ig.generate(input_ids, max_new_tokens=N, ...)`` runs two programs built from the text program by
``passes.decode.OpenCache``: the *prompt* program (the prompt in one pass, chunked delta rule) and the
*decode* program (one token, the token-by-token delta rule). Both take the cache as inputs and
return its successor as outputs: each attention block's keys and values (``[batch, kv_heads, past,
head_dim]``, after the rotary), each DeltaNet block's recurrent state and conv context, and what else
the family declares (``Family.memories``: qwen4_exp's indexer keys and PLE contexts). Positions
and the attention mask follow HF ``generate``: positions are ``cumsum(attention_mask) - 1`` (so
left padding is skipped), the mask grows by a column of ones per step.

``out.steps[0]`` holds the values of the prompt pass; ``out.steps[k]`` (k >= 1) those of the pass
that reads the k-th new token (a one-token pass: sequence axes have length 1, attention patterns
are ``[batch, heads, 1, past + 1]``). ``out.logits`` and ``out.scores`` are HF ``generate``'s
``output_logits`` and ``output_scores``: one per new token, from the pass that chose it. The pass
over the last new token chooses nothing: it runs only when the call captures values (its step holds
them), so ``len(out.steps)`` is ``len(out.logits) + 1`` with values and ``len(out.logits)`` without.
"""
from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass, field

import torch

from . import compat
from .values import derive
from .edits import needs
from .errors import InvalidArgument, InvalidType, NotCaptured, NotSupported, QgraphError
from .export import export_model
from .inputs import image_keys, prepare
from .decode_cache import causal_mask, empty_cache, next_cache
from .values.names import canonical
from .passes.decode import carried
from .passes.edit import applying
from .program import Program
from .progress import progress
from .reprs import generated


class Step(dict):
    """One step's captured values, ``{name: tensor}``; also takes the spellings ``values=`` takes."""

    def __init__(self, values: dict, logits: torch.Tensor, blocks: int):
        super().__init__(values)
        self.logits, self._blocks = logits, blocks

    def __getitem__(self, name):
        key = canonical(name, self._blocks) if not dict.__contains__(self, name) else name
        if not dict.__contains__(self, key):
            raise NotCaptured(f"'{name}' was not captured; captured: {', '.join(self) or 'nothing'}")
        return dict.__getitem__(self, key)

    def __contains__(self, name):
        return dict.__contains__(self, name) or dict.__contains__(self, canonical(name, self._blocks))


@dataclass
class GenerateOutput:
    """What ``ig.generate`` returns.

    ``sequences``: the prompt and the new tokens ``[batch, prompt + new]`` (rows that stopped are
    filled with the pad id, as HF does). ``steps``: one ``Step`` per pass (0: the prompt, k: the
    pass over new token k), each with its values and its pass's ``logits``; the pass over the last
    new token runs only for its values (none captured: no pass, so one step per new token).
    ``logits`` and ``scores``: one per new token, as HF ``generate(output_logits=True,
    output_scores=True, return_dict_in_generate=True)`` returns them: the raw logits at the last
    position of the pass that chose it (float32 ``[batch, vocab]``), and those scores processed (by
    temperature, top_k, top_p, ...) into the distribution it was chosen from.
    """

    sequences: torch.Tensor
    steps: list[Step] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    def stacked(self, name: str, position: int = -1) -> torch.Tensor:
        """A value over the steps, stacked on a new axis 1: each step's ``[:, position]`` along its
        sequence axis (axis 1), the prompt pass included at its last position."""
        return torch.stack([step[name][:, position] for step in self.steps], dim=1)

    def __repr__(self) -> str:  # short: the sequences' shape, the steps, the values per step (qgraph/reprs.py)
        return generated(self).text()

    def _repr_html_(self) -> str:
        return generated(self).html()


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
        raise InvalidType("enable_thinking must be True or False: the templates' defaults differ by model size")
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

    def __init__(self, ig, values: list[str], options: dict, slots: dict):
        exported = export_model(ig.model, images=False)
        self.ig = ig
        self.memory = ig.family.memories(ig.config)
        self.prompt = self._build(ig, exported, values, options, slots, recurrent=False)
        self.decode = self._build(ig, exported, values, options, slots, recurrent=True)
        self.values = [name for name in values if name in self.present]

    def _build(self, ig, exported, values, options, slots, recurrent) -> Program:
        program = Program(ig.model, exported, saes=ig.saes, transcoders=ig.transcoders)
        present = self.present = program.present
        return program.build([name for name in values if name in present],
                             {name: slot for name, slot in slots.items() if name in present}, True,
                             {name: option for name, option in options.items() if name in present},
                             cache="decode" if recurrent else "prompt", make=carried(ig.family, ig.config))

    def empty_cache(self, batch: int) -> dict[str, torch.Tensor]:
        return empty_cache(self.ig.family, self.ig.config, batch, next(self.ig.model.parameters()))

    def next_cache(self, captured: dict) -> dict[str, torch.Tensor]:
        return next_cache(self.memory, captured)


def _selected(steps, step: int, total_hint: int) -> bool:
    if steps is None:
        return True
    if isinstance(steps, slice):
        return step in range(total_hint)[steps]
    if isinstance(steps, int):
        return step == steps
    return step in set(steps)


# The smallest valid value of each length argument (None: the model's generation_config, then HF's defaults).
LENGTHS = {"max_new_tokens": 1, "max_length": 1, "min_new_tokens": 0, "min_length": 0}

# HF generation-config fields generate honours through HF's own logits processors, beyond its named
# arguments; output_*/return_dict_in_generate/use_cache are accepted as no-ops (GenerateOutput always
# holds the scores and logits, and decoding always uses the cache).
SETTINGS = ("min_p", "typical_p", "top_h", "epsilon_cutoff", "eta_cutoff", "repetition_penalty",
            "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
            "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty",
            "remove_invalid_values", "renormalize_logits", "bos_token_id", "output_scores", "output_logits",
            "return_dict_in_generate", "use_cache")
ARGUMENTS = ("input_ids", "attention_mask", "max_new_tokens", "max_length", "min_new_tokens", "min_length",
             "values", "edits", "steps", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
             "pad_token_id", "generator", "seed")


def _check_length(name: str, value) -> None:
    """A ValueError unless ``value`` is None or an int of at least ``LENGTHS[name]``."""
    if value is None:
        return
    low = LENGTHS[name]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        counts = "counting the prompt" if name.endswith("length") else "not counting the prompt"
        raise InvalidArgument(f"{name} must be an int >= {low} ({counts}) or None, got {value!r}")


def _check_keywords(kwargs: dict) -> None:
    """Unknown keyword arguments raise a TypeError listing what generate takes; HF generation-config
    fields that generate does not implement (beam search, several sequences per prompt, ...) raise a
    NotImplementedError when set to anything but their default."""
    fields = compat.generation_settings()  # {name: HF's default}
    unknown = sorted(name for name in kwargs if name not in fields)
    if unknown:
        raise InvalidType(f"generate() got unexpected keyword argument(s) {unknown}; it takes "
                          f"{', '.join(ARGUMENTS)} and the HF generation settings {', '.join(SETTINGS)}")
    if kwargs.get("num_beams") not in (None, 1):
        raise NotSupported("beam search is not supported (num_beams="
                           f"{kwargs['num_beams']!r}): generate decodes greedily or by sampling")
    for name, value in kwargs.items():
        plain = isinstance(value, (bool, int, float, str)) and value == fields[name]
        if name not in SETTINGS and value is not None and not plain:
            raise NotSupported(f"generate does not support {name}={value!r}: it decodes one sequence per "
                               f"prompt, greedily or by sampling; leave {name} unset")


def _limit_lengths(model, config, max_length, prompt_length: int) -> None:
    """Set ``config.max_length`` / ``config.min_length`` to totals counting the prompt, by HF
    ``generate``'s rules: ``max_new_tokens`` wins over ``max_length``; with neither given (here or in
    the model's generation_config) HF's default of 20 new tokens applies, capped at
    ``max_position_embeddings``; ``min_new_tokens`` wins over ``min_length``."""
    if config.max_new_tokens is not None:
        config.max_length = config.max_new_tokens + prompt_length
    elif max_length is None and model.generation_config.max_length is None:
        config.max_length = config.max_length + prompt_length
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions is not None:
            config.max_length = min(config.max_length, positions)
    for name in LENGTHS:
        _check_length(name, getattr(config, name))  # the model's generation_config may set them too
    if prompt_length >= config.max_length:
        raise InvalidArgument(f"max_length ({config.max_length}) counts the prompt and must exceed its length "
                              f"({prompt_length}): pass max_length > {prompt_length}, or max_new_tokens instead")
    if config.min_new_tokens is not None:
        config.min_length = config.min_new_tokens + prompt_length
    if config.min_length is not None and config.min_length > config.max_length:
        warnings.warn(f"min_length / min_new_tokens ask for {config.min_length} tokens in all, more than max_length "
                      f"({config.max_length}): generation stops at max_length", UserWarning, stacklevel=5)


def check_settings(model, prompt_ids: torch.Tensor, *, max_new_tokens=None, max_length=None, min_new_tokens=None,
                   min_length=None, do_sample: bool = False, temperature=None, top_k=None, top_p=None,
                   eos_token_id=None, pad_token_id=None, seed=None, **generation_kwargs):
    """Every generation setting checked, before anything runs (``generate`` calls this first, and ``qgraph
    serve`` before it queues a request): ``(processors, config)``, HF's own logits processors for the settings
    and a prompt of ``prompt_ids``, and the generation config they come from. A setting HF refuses
    (``temperature=0`` or ``top_k=-5`` with sampling, ``repetition_penalty=0``, ...) is an InvalidArgument
    naming it; an unknown one a TypeError, an unsupported one a NotImplementedError."""
    lengths = {"max_new_tokens": max_new_tokens, "max_length": max_length, "min_new_tokens": min_new_tokens,
               "min_length": min_length}
    for name, value in lengths.items():
        _check_length(name, value)
    _check_keywords(generation_kwargs)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                             or not -2**63 <= int(seed) < 2**64):
        raise InvalidArgument(f"seed is {str(seed)[:40]}: give an int from -2**63 to 2**64 - 1 (what a torch "
                              f"generator takes), or leave it out")
    settings = {"do_sample": do_sample, **{name: value for name, value in lengths.items() if value is not None},
                **generation_kwargs}
    for name, setting in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                          ("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if setting is not None:
            settings[name] = setting
    try:
        return _processors(model, settings, prompt_ids)  # checks the lengths against the prompt
    except QgraphError:
        raise
    except ValueError as error:  # HF refuses a value (its processors check theirs as they are made)
        reason = " ".join(str(error).split())[:400] or type(error).__name__
        refused = _refused(model, settings, prompt_ids)
        if refused is None:
            raise InvalidArgument(f"transformers refuses these generation settings ({reason}): change "
                                  f"{', '.join(sorted(settings))}, or leave them out") from None
        raise InvalidArgument(f"generate's {refused}={settings[refused]!r} is refused by transformers ({reason}): "
                              f"change {refused}, or leave it out for the model's default") from None


def _refused(model, settings: dict, prompt_ids: torch.Tensor) -> str | None:
    """The setting HF refuses: the first that fails beside do_sample and the lengths alone (None if none does)."""
    base = {name: value for name, value in settings.items() if name == "do_sample" or name in LENGTHS}
    for name, value in settings.items():
        if name not in base:
            try:
                _processors(model, {**base, name: value}, prompt_ids)
            except QgraphError:
                continue
            except ValueError:
                return name
    return None


def _processors(model, generation_kwargs: dict, prompt_ids: torch.Tensor):
    """HF's own logits processors for these settings (temperature, top_k, top_p, repetition
    penalty, min_new_tokens, ...), and the generation config they come from, its ``max_length``
    and ``min_length`` resolved to totals that count the prompt."""
    config = compat.generation_config(model, **generation_kwargs)
    _limit_lengths(model, config, generation_kwargs.get("max_length"), prompt_ids.shape[1])
    processors = compat.logits_processors(model, config, prompt_ids)
    return processors, config


def _steps(new_tokens: int):
    """The pass numbers 0 (the prompt) to ``new_tokens`` (a hard bound on the loop), with a progress
    bar over the new tokens on stderr once generation lasts 2 s (``qgraph.progress``)."""
    with progress("generating", total=new_tokens, unit="token") as bar:
        for step in range(new_tokens + 1):
            yield step
            bar.update()


def generate(ig, input_ids=None, attention_mask=None, *, max_new_tokens: int | None = None,
             max_length: int | None = None, min_new_tokens: int | None = None, min_length: int | None = None,
             values=None, edits=None, steps=None, do_sample: bool = False, temperature=None, top_k=None,
             top_p=None, eos_token_id=None, pad_token_id=None, generator: torch.Generator | None = None,
             seed: int | None = None, **generation_kwargs) -> GenerateOutput:
    """See ``InstrumentedModel.generate``. Lengths follow HF ``generate``: ``max_new_tokens`` wins
    over ``max_length`` (which counts the prompt and must exceed it); with neither given, here or in
    ``model.generation_config``, 20 new tokens (HF's default); ``min_new_tokens`` / ``min_length`` keep
    eos out until reached. Other HF generation settings pass through to HF's logits processors
    (``SETTINGS``); unknown keyword arguments raise a TypeError, unsupported ones (``num_beams > 1``,
    ``num_return_sequences > 1``, ...) a NotImplementedError, values HF refuses an InvalidArgument naming
    them, all before any work (``check_settings``)."""
    if ig.family.not_generating:
        raise NotSupported(f"generate does not run {ig.family.name} models yet: {ig.family.not_generating}. "
                           "A call (ig(ids)) runs the whole prompt, with its values")
    if any(generation_kwargs.get(key) is not None for key in image_keys(ig.family)):
        raise NotSupported("generate with images is not supported yet: generate takes text only "
                           "(input_ids, attention_mask); a text-only prompt works on the image-text model")
    for key in image_keys(ig.family):
        generation_kwargs.pop(key, None)
    model = ig.model
    prepared = prepare(model, None, input_ids, attention_mask)
    ids, mask = prepared["input_ids"], prepared["attention_mask"]
    processors, config = check_settings(
        model, ids, max_new_tokens=max_new_tokens, max_length=max_length, min_new_tokens=min_new_tokens,
        min_length=min_length, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, seed=seed, **generation_kwargs)
    ig.refresh()
    max_new_tokens = config.max_length - ids.shape[1]  # new tokens at most: HF's rules resolved
    eos = config.eos_token_id
    if eos is None:
        eos = model.config.get_text_config().eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    eos_ids = torch.tensor(eos, dtype=torch.long, device=ids.device)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    if do_sample and generator is None and seed is not None:
        generator = torch.Generator(device=ids.device).manual_seed(seed)
    if values is None:
        names, options = ig.values, ig.options
    else:
        names, options = ig.resolve(list(values)), ig.check_options(values)
    call_edits = ig.call_edits(edits)  # {name: edit}; undeclared names get slots in this decoder's programs
    reads = {name: needs(edit) for name, edit in call_edits.items()}
    slots = {name: ig.slot(name, reads.get(name, ())) for name in {*ig.slots, *call_edits}}
    decoder = ig.decoder((tuple(names), frozenset((name, slot.read_names) for name, slot in slots.items())),
                         lambda: Decoder(ig, names, options, slots))

    batch, prompt_length = ids.shape
    blocks = len(ig.family.block_mixers(ig.config))
    cache = decoder.empty_cache(batch)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    sequences, full_mask, new_ids = ids, mask, ids
    unfinished = torch.ones(batch, dtype=torch.bool, device=ids.device)
    output = GenerateOutput(sequences)
    edits = edits or {}
    last = False
    for step in _steps(max_new_tokens):  # a hard bound: the prompt pass, then one pass per new token but the last
        new = new_ids.shape[1]
        inputs = {"input_ids": new_ids, "attention_mask": full_mask[:, -new:],
                  "positions": positions if ig.family.rotary_reads_past else positions[:, -new:],
                  "causal_mask": causal_mask(full_mask, new), **cache}
        program = decoder.prompt if step == 0 else decoder.decode
        active = {slots[name]: edit for name, edit in call_edits.items()} \
            if call_edits and _selected(steps, step, max_new_tokens + 1) else {}
        with applying(active), torch.no_grad():
            logits, captured = program.run(inputs)
        cache = decoder.next_cache(captured)
        derive.fill(captured, program.derivations, inputs, ig.config)
        output.steps.append(Step({name: captured[name] for name in decoder.values if name in captured},
                                 logits, blocks))
        if last:
            break
        raw = logits[:, -1].to(copy=True, dtype=torch.float32)  # HF's next_token_logits: output_logits holds it
        scores = processors(sequences, raw)
        output.logits.append(raw)
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
        last = step + 1 == max_new_tokens or not bool(unfinished.any())
        if last and not decoder.values:  # the last token's pass would choose nothing and read nothing
            break
    output.sequences = sequences
    return output
