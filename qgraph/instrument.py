"""``qgraph.instrument``: one exported program per model, tapped for the values asked for."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind

from .catalogue import Entry, build_catalogue
from .edits import EditError, Target
from .export import ExportedModel, export_model
from .names import canonical, resolve
from .passes import Found, Locator, OnRequest, decompose_sdpa, strip_markers, tap
from .passes.edit import EditSlot, insert_edit_slots, name_of

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


def instrument(model: torch.nn.Module, values=(), *, edits=(), logits: bool = True) -> "InstrumentedModel":
    """Export ``model`` (once; later calls reuse it) and tap ``values`` as extra program outputs.

    ``values`` takes names, globs (``layers.*.layer_output``; ``*`` stays within one dotted part,
    ``**`` crosses them) and the bracket form (``layers[3].self_attn.attention_scores``).
    ``edits`` declares edit slots: a list of names (edits given per call, ``ig(..., edits={...})``)
    or a dict ``{name: edit}`` of edits fixed into the program. With ``logits=False`` the program
    returns only the captured values, and what only the logits needed (``lm_head``, blocks past the
    last value) is not computed.
    """
    return InstrumentedModel(model, export_model(model), values, edits=edits, logits=logits)


class InstrumentedModel:
    """A model's forward as a graph whose outputs include the values asked for.

    Call it like the model (``ig(input_ids=..., attention_mask=...)`` or ``ig(**tokenizer(...))``),
    with ``edits={name: edit}`` for the declared slots; it returns an ``Output``. The model's
    parameters are read at call time, never copied.
    """

    def __init__(self, model: torch.nn.Module, exported: ExportedModel, values=(), *, edits=(), logits=True):
        self.model, self.exported, self.family = model, exported, exported.family
        self.config = model.config
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(exported.graph, {}))
        module_names = _module_names(model, self.family)
        self.catalogue: dict[str, Entry] = build_catalogue(
            self.family, self.config, Locator(graph, self.family, self.config), module_names)
        self.values = self._resolve(values)
        # values a pass must first make (a block's pattern under sdpa): make them, then look again
        requested = self.values + self._resolve(list(edits))
        to_decompose = {self.catalogue[name].location.node for name in requested
                        if isinstance(self.catalogue[name].location, OnRequest)}
        if to_decompose:
            for sdpa in to_decompose:
                decompose_sdpa(graph, sdpa)
            self.catalogue = build_catalogue(
                self.family, self.config, Locator(graph, self.family, self.config), module_names)
        self._derived = {name: self.catalogue[name].spec.rule for name in self.values if self.catalogue[name].derived}

        fixed = {name: edit for pattern, edit in edits.items() for name in self._resolve(pattern)} \
            if isinstance(edits, Mapping) else {}
        self.slots: dict[str, EditSlot] = {}
        for name in self._resolve(list(edits)):
            entry = self.catalogue[name]
            if entry.read_only:
                raise EditError(f"'{name}' is read-only ({entry.description}); " + _READ_ONLY_HINT.get(
                    name, "edit the value it is derived from"))
            target = Target(name, entry.layout, tuple(map(str, entry.spec.dims if entry.spec else entry.shape)))
            self.slots[name] = EditSlot(target, entry.location.split_heads, fixed=fixed.get(name))
        slot_nodes = insert_edit_slots(graph, {name: (self.catalogue[name].location, slot, self.catalogue[name].spec is None)
                                               for name, slot in self.slots.items()})

        wanted = [name for name in self.values if name not in self._derived]
        wanted += [rule.source for rule in self._derived.values() if rule.source not in wanted]
        found = {}
        for name in wanted:
            location = self.catalogue[name].location
            found[name] = Found(slot_nodes[name], location.split_heads) if name in slot_nodes else location
        self._tapped = tap(graph, found)
        output = graph.output_node()
        if not logits:  # drop the model's own outputs, and with them what only they needed
            output.args = (tuple(output.args[0])[len(exported.program.graph_signature.output_specs):],)
        self._logits = logits
        strip_markers(graph)
        attributes = {node.target: getattr(exported.program.graph_module, node.target)
                      for node in graph.find_nodes(op="get_attr")}
        self.program = torch.fx.GraphModule({**attributes, **{name_of(n): s for n, s in self.slots.items()}}, graph)
        graph.eliminate_dead_code()  # needs the owning module to judge the slots' purity
        graph.lint()
        self.program.recompile()
        self._sources = _input_sources(model, exported)

    def _resolve(self, patterns) -> list[str]:
        return resolve(patterns, self.catalogue, self.family.block_mixers(self.config)) if patterns else []

    # -- running ---------------------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 *, edits: Mapping | None = None, **unexpected) -> Output:
        if unexpected:
            raise TypeError(f"unexpected inputs {sorted(unexpected)}: an instrumented text model takes "
                            f"input_ids, attention_mask and edits")
        input_ids, attention_mask = _check_inputs(input_ids, attention_mask)
        user = {"input_ids": input_ids, "attention_mask": attention_mask}
        flat = [source(user) for source in self._sources]
        active = self._activate(edits or {})
        try:
            results = list(self.program(*flat))
        finally:
            for slot in active:  # an edit lasts one call
                slot.edit = None
        logits = results.pop(0) if self._logits else None
        captured = dict(zip(self._tapped, results))
        for name, rule in self._derived.items():
            captured[name] = _derive(rule.how, captured[rule.source])
        return Output(logits, {name: captured[name] for name in self.values}, len(self.family.block_mixers(self.config)))

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


def _module_names(model, family) -> list[str]:
    return [name for name in (family.module_name(path) for path, _ in model.named_modules()) if name]


def _check_inputs(input_ids, attention_mask):
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError("input_ids is required: a LongTensor [batch, seq] (e.g. ig(**tokenizer(text, return_tensors='pt')))")
    if input_ids.dim() == 1:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; it must be [batch, seq]: "
                         f"add the batch dim with input_ids[None]")
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise ValueError(f"input_ids must be an integer tensor [batch, seq], got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
    input_ids = input_ids.long()
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                         f"{tuple(input_ids.shape)}; they must match")
    return input_ids, attention_mask.long()


def _input_sources(model, exported: ExportedModel):
    """For each program input, a function of the user inputs giving its tensor (parameters are the model's)."""
    sources = []
    for spec in exported.program.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            module_path, _, attribute = spec.target.rpartition(".")
            module = model.get_submodule(module_path)
            sources.append(lambda user, m=module, a=attribute: getattr(m, a))
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            constant = exported.program.constants[spec.target]
            sources.append(lambda user, c=constant: c)
        elif hasattr(spec.arg, "value"):  # a constant argument such as use_cache=False
            sources.append(lambda user, v=spec.arg.value: v)
        else:
            sources.append(lambda user, n=spec.arg.name: user[n])
    return sources


def _derive(how: str, source: torch.Tensor):
    if how == "last_position_softmax":
        return torch.softmax(source[:, -1].float(), dim=-1)
    if how == "size":
        return torch.Size(source.shape)
    raise ValueError(how)
