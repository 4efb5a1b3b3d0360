"""``qgraph.instrument``: one exported program per model, tapped for the values asked for."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from . import derive
from .catalogue import Entry
from .compile import compile_options, compile_program
from .edits import EditError, Target
from .export import ExportedModel, export_model
from .inputs import IMAGE_KEYS, prepare
from .names import canonical, resolve
from .passes import Found, OnRequest
from .passes.edit import EditSlot
from .program import Program

# The options a value takes in ``values={name: {...}}``
_OPTIONS = {"states": ("dtype", "heads"), "state": ("positions", "dtype", "heads")}

_READ_ONLY_HINT = {
    "next_token_probs": "edit 'logits' instead",
    "input_size": "call with other inputs instead",
    "input_ids": "pass other tokens instead",
    "attention_mask": "pass another attention_mask instead",
}


@dataclass
class Output:
    """What an instrumented call returns: the model's logits and the captured values by name.

    ``out[name]`` takes the spellings ``values=`` takes (``layers[-1].layer_output``).
    """

    logits: torch.Tensor | None
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    blocks: int = 0  # the model's block count, to read negative block indices

    def __getitem__(self, name: str) -> torch.Tensor:
        key = canonical(name, self.blocks)
        if key not in self.values:
            raise KeyError(f"'{name}' was not captured; captured: {', '.join(self.values) or 'nothing'}")
        return self.values[key]

    def __contains__(self, name: str) -> bool:
        return canonical(name, self.blocks) in self.values


def instrument(model: torch.nn.Module, values=(), *, edits=(), logits: bool = True,
               compile=False) -> "InstrumentedModel":
    """Export ``model`` (once; later calls reuse it) and tap ``values`` as extra program outputs.

    ``values`` takes names, globs (``layers.*.layer_output``; ``*`` stays within one dotted part,
    ``**`` crosses them) and the bracket form (``layers[3].self_attn.attention_scores``); a dict
    ``{name: options}`` also passes options (``{"layers.0.linear_attn.state": {"positions": [0, -1]}}``;
    ``states`` and ``state`` take ``dtype=`` and ``heads=`` too).
    ``edits`` declares edit slots: a list of names (edits given per call, ``ig(..., edits={...})``)
    or a dict ``{name: edit}`` of edits fixed into the program. With ``logits=False`` the program
    returns only the captured values, and what only the logits needed (``lm_head``, blocks past the
    last value) is not computed. ``compile=True`` (or a dict of ``torch.compile`` options) runs the
    program under ``torch.compile`` (see ``InstrumentedModel.compile``).
    """
    instrumented = InstrumentedModel(model, export_model(model), values, edits=edits, logits=logits)
    options = compile_options(compile)
    return instrumented if options is None else instrumented.compile(**options)


class InstrumentedModel:
    """A model's forward as a graph whose outputs include the values asked for.

    Call it like the model (``ig(input_ids=..., attention_mask=...)``, ``ig(**tokenizer(...))`` or,
    on the image-text model, ``ig(**processor(text=..., images=..., return_tensors="pt"))``), with
    ``edits={name: edit}`` for the declared slots; it returns an ``Output``. The model's parameters
    are read at call time, never copied.
    """

    def __init__(self, model: torch.nn.Module, exported: ExportedModel, values=(), *, edits=(), logits=True):
        self.model, self.exported, self.family = model, exported, exported.family
        self.config = model.config
        main = Program(model, exported)
        self.catalogue: dict[str, Entry] = main.catalogue
        self.values = self._resolve(list(values))
        self.options = self._options(values)
        fixed = {name: edit for pattern, edit in edits.items() for name in self._resolve(pattern)} \
            if isinstance(edits, Mapping) else {}
        self.slots: dict[str, EditSlot] = {}
        for name in self._resolve(list(edits)):
            entry = self.catalogue[name]
            if entry.read_only:
                raise EditError(f"'{name}' is read-only ({entry.description}); " + _READ_ONLY_HINT.get(
                    name, "edit the value it is derived from"))
            target = Target(name, entry.layout, tuple(map(str, entry.spec.dims if entry.spec else entry.shape)))
            self.slots[name] = EditSlot(target, entry.location.view, fixed=fixed.get(name))
        self._logits = logits
        self._programs = {exported.images: main.build(self.values, self.slots, logits, self.options)}
        self.catalogue = main.catalogue  # as built: a decomposed block's pattern is now found

    def _options(self, values) -> dict[str, dict]:
        """Per-value options from ``values={name: {option: ...}}``, checked against what each value takes."""
        given = {}
        if isinstance(values, Mapping):
            for pattern, option in values.items():
                given.update(dict.fromkeys(self._resolve(pattern), dict(option or {})))
        options = {}
        for name in self.values:
            kind = self.catalogue[name].spec.name if self.catalogue[name].spec else ""
            option, allowed = given.get(name, {}), _OPTIONS.get(kind, ())
            unknown = set(option) - set(allowed)
            if unknown:
                raise ValueError(f"'{name}' takes no option {sorted(unknown)}"
                                 + (f"; it takes {list(allowed)}" if allowed else ""))
            if kind == "state" and "positions" not in option:
                raise ValueError(f"'{name}' needs positions: ask values={{'{name}': {{'positions': [...]}}}}, the "
                                 f"tokens after which to read the state (or ask for 'states', every token)")
            if option:
                options[name] = option
        return options

    def _resolve(self, patterns) -> list[str]:
        return resolve(patterns, self.catalogue, self.family.block_mixers(self.config),
                       self.family.vision_blocks(self.config)) if patterns else []

    @property
    def program(self) -> torch.fx.GraphModule:
        """The runnable program (of the image-text program on the image-text model)."""
        return self._programs[self.exported.images].module

    @property
    def graph(self) -> torch.fx.Graph:
        """The program's graph, taps and slots included (markers already removed)."""
        return self.program.graph

    def _program_for(self, images: bool) -> Program:
        """The program a call runs: a text-only call to the image-text model runs its text program."""
        if images not in self._programs:
            text = Program(self.model, export_model(self.model, images=False))
            present = {name for name, entry in text.catalogue.items() if isinstance(entry.location, (Found, OnRequest))}
            present |= {name for name, entry in text.catalogue.items()
                        if entry.derived and set(Program.sources_of(entry)) <= present}
            self._programs[images] = text.build([n for n in self.values if n in present],
                                                {n: s for n, s in self.slots.items() if n in present}, self._logits,
                                                self.options)
            if getattr(self, "_compile", None) is not None:
                compile_program(self._programs[images], **self._compile)
        return self._programs[images]

    def compile(self, **options) -> "InstrumentedModel":
        """Run the program(s) under ``torch.compile`` (``fullgraph=True`` unless ``options`` say
        otherwise); returns self. The first call compiles; the batch and sequence dims are dynamic,
        so a new prompt length does not recompile. A call with per-call edits runs the eager program
        (see ``qgraph.compile``)."""
        self._compile = options
        for program in self._programs.values():
            compile_program(program, **options)
        return self

    def release_buffers(self) -> None:
        """Give back the memory kept from earlier calls' states. A program that captures states
        keeps the memory of the states you have dropped and writes the next call's states there
        (on CPU, fresh memory costs more to fill than the states cost to compute); tensors you
        still hold are never reused. Deleting the instrumented model releases it too."""
        for program in self._programs.values():
            program.buffers.release()

    # -- running ---------------------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 *, edits: Mapping | None = None, **inputs) -> Output:
        images = self.exported.images and inputs.get("pixel_values") is not None
        if not self.exported.images and any(inputs.get(key) is not None for key in IMAGE_KEYS):
            raise TypeError(f"{type(self.model).__name__} is text-only and takes no images "
                            f"({', '.join(k for k in IMAGE_KEYS if inputs.get(k) is not None)}): load the image-text "
                            f"model, Qwen3_5ForConditionalGeneration")
        if not images and inputs.get("image_grid_thw") is not None:
            raise ValueError("image_grid_thw came without pixel_values: pass both, as the processor returns them")
        prepared = prepare(self.model, images, input_ids, attention_mask, **inputs)
        program = self._program_for(images)
        active = self._activate(edits or {})
        try:
            logits, captured = program.run(prepared, eager=bool(active))
        finally:
            for slot in active:  # an edit lasts one call
                slot.edit = None
        for name, entry in program.derived.items():
            how = getattr(derive, entry.spec.rule.how)
            captured[name] = how(*(captured[s] for s in program.sources_of(entry)), inputs=prepared, config=self.config)
        values = {name: captured[name] for name in self.values if name in captured}
        return Output(logits, values, len(self.family.block_mixers(self.config)))

    def _activate(self, edits: Mapping) -> list[EditSlot]:
        active = []
        for pattern, edit in edits.items():
            names = self._resolve(pattern)
            undeclared = [name for name in names if name not in self.slots]
            if undeclared:
                declared = ", ".join(self.slots) or "none"
                raise EditError(f"no edit slot for {undeclared}: declare it with qgraph.instrument(model, "
                                f"edits=[...]) (declared slots: {declared})")
            for name in names:
                self.slots[name].edit = edit
                active.append(self.slots[name])
        return active

    # -- generating --------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 **kwargs):
        """Generate like HF ``generate`` (greedy, or sampling with ``do_sample=True``, ``temperature``,
        ``top_k``, ``top_p``, ``generator=``/``seed=``; stops on the config's eos ids), decoding from a
        cache, and capture the values at every step: ``out.sequences`` and ``out.steps[k][name]``
        (step 0 the prompt pass, step k the pass over new token k). ``edits={name: edit}`` apply at
        every step, or at ``steps=[0]`` / ``steps=slice(1, None)`` only. See ``qgraph.generate``."""
        from .generate import generate
        return generate(self, input_ids, attention_mask, **kwargs)

    # -- reading the stream -------------------------------------------------------------------
    def project_on_vocab(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of a residual-stream tensor: the model's final norm (its ``1 + weight`` gain), then
        its lm_head, so ``project_on_vocab(layers[-1].layer_output) == logits``."""
        modules = {self.family.module_name(path): module for path, module in self.model.named_modules()}
        norm, head = (modules[path] for path in self.family.data.READOUT)
        return head(norm(hidden))

    def logit_lens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   positions=(-1,), top: int = 5) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Every block's top tokens at ``positions``: ``{block: (token ids, probabilities)}``, each
        ``[batch, len(positions), top]``, from ``project_on_vocab`` of the block's ``layer_output``."""
        lens = instrument(self.model, values=["layers.*.layer_output"], logits=False)
        out = lens(input_ids, attention_mask)
        result = {}
        for block in range(len(self.family.block_mixers(self.config))):
            hidden = out[f"layers.{block}.layer_output"][:, list(positions)]
            probs = self.project_on_vocab(hidden).float().softmax(-1).topk(top, dim=-1)
            result[block] = (probs.indices, probs.values)
        return result

    # -- looking -----------------------------------------------------------------------------------
    @property
    def graph(self) -> torch.fx.Graph:
        """The program's graph, taps included (markers already removed)."""
        return self.program.graph

    def __repr__(self) -> str:
        from .support import annotated_tree
        return annotated_tree(self.model, self.catalogue, highlight=set(self.values))
