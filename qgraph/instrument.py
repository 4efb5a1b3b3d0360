"""``qgraph.instrument``: one exported program per model, tapped for the values asked for."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind

from .catalogue import Entry, build_catalogue
from .export import ExportedModel, export_model
from .names import normalize, resolve
from .passes import Found, Locator, strip_markers, tap


@dataclass
class Output:
    """What an instrumented call returns: the model's logits and the captured values by name."""

    logits: torch.Tensor | None
    values: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        key = normalize(name)
        if key not in self.values:
            raise KeyError(f"'{name}' was not captured; captured: {', '.join(self.values) or 'nothing'}")
        return self.values[key]

    def __contains__(self, name: str) -> bool:
        return normalize(name) in self.values


def instrument(model: torch.nn.Module, values=(), *, logits: bool = True) -> "InstrumentedModel":
    """Export ``model`` (once; later calls reuse it) and tap ``values`` as extra program outputs.

    ``values`` takes names, globs (``layers.*.layer_output``) and the bracket form
    (``layers[3].self_attn.attention_scores``). With ``logits=False`` the program returns only the
    captured values, and everything past the last one (``lm_head``, later blocks) is not computed.
    """
    return InstrumentedModel(model, export_model(model), values, logits=logits)


class InstrumentedModel:
    """A model's forward as a graph whose outputs include the values asked for.

    Call it like the model (``ig(input_ids=..., attention_mask=...)`` or ``ig(**tokenizer(...))``);
    it returns an ``Output``. The model's parameters are read at call time, never copied.
    """

    def __init__(self, model: torch.nn.Module, exported: ExportedModel, values=(), *, logits: bool = True):
        self.model, self.exported, self.family = model, exported, exported.family
        self.config = model.config
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(exported.graph, {}))
        self.catalogue: dict[str, Entry] = build_catalogue(
            self.family, self.config, Locator(graph, self.family, self.config), _module_names(model, self.family))
        self.values = resolve(values, self.catalogue, self.family.block_mixers(self.config)) if values else []
        self._derived = {name: self.catalogue[name].spec.rule for name in self.values if self.catalogue[name].derived}

        wanted = [name for name in self.values if name not in self._derived]
        wanted += [rule.source for rule in self._derived.values() if rule.source not in wanted]
        self._tapped = tap(graph, {name: self.catalogue[name].location for name in wanted})
        output = graph.output_node()
        if not logits:  # drop the model's own outputs, and with them what only they needed
            output.args = (tuple(output.args[0])[len(exported.program.graph_signature.output_specs):],)
        self._logits = logits
        strip_markers(graph)
        graph.eliminate_dead_code()
        graph.lint()
        self.program = torch.fx.GraphModule(exported.program.graph_module, graph)
        self._sources = _input_sources(model, exported)

    # -- running ---------------------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 **unexpected) -> Output:
        if unexpected:
            raise TypeError(f"unexpected inputs {sorted(unexpected)}: an instrumented text model takes "
                            f"input_ids and attention_mask")
        input_ids, attention_mask = _check_inputs(input_ids, attention_mask)
        user = {"input_ids": input_ids, "attention_mask": attention_mask}
        flat = [source(user) for source in self._sources]
        results = list(self.program(*flat))
        logits = results.pop(0) if self._logits else None
        captured = dict(zip(self._tapped, results))
        for name, rule in self._derived.items():
            captured[name] = _derive(rule.how, captured[rule.source])
        return Output(logits, {name: captured[name] for name in self.values})

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
