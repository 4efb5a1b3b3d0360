"""One exported program, tapped for values and fitted with edit slots, ready to run."""
from __future__ import annotations

import re

import torch
from torch.export.graph_signature import InputKind
from torch.fx import Node

from .catalogue import Entry, build_catalogue
from .kernels.buffers import BufferPool, reusing
from .export import ExportedModel
from .passes import Found, Locator, OnRequest, decompose_sdpa, strip_markers, tap
from .passes.edit import EditSlot, insert_edit_slots, name_of
from .passes.swap import open_conv_context, swap_for_states


class Program:
    """A copy of an exported graph with its catalogue; ``build`` runs the passes for a request."""

    def __init__(self, model: torch.nn.Module, exported: ExportedModel):
        self.model, self.exported, self.family = model, exported, exported.family
        self.graph = torch.fx.Graph()
        self.graph.output(self.graph.graph_copy(exported.graph, {}))
        self.module_names = [name for _, name in self.family.ported_modules(model)]
        self.catalogue: dict[str, Entry] = self._catalogue()
        self.module: torch.fx.GraphModule | None = None
        self.compiled = None  # the module under torch.compile, once compiled (qgraph.compile)
        self.buffers = BufferPool()  # big state buffers kept for the next call (kernels.buffers.BufferPool)

    @property
    def present(self) -> set[str]:
        """The names this program can serve (a text-only program has no vision values)."""
        present = {name for name, entry in self.catalogue.items() if isinstance(entry.location, (Found, OnRequest))}
        return present | {name for name, entry in self.catalogue.items()
                          if entry.derived and set(self.sources_of(entry)) <= present}

    def _catalogue(self) -> dict[str, Entry]:
        return build_catalogue(self.family, self.model.config, Locator(self.graph, self.family, self.model.config),
                               self.module_names)

    def build(self, values: list[str], slots: dict[str, EditSlot], logits: bool,
              options: dict[str, dict] | None = None, rewrite=None) -> "Program":
        """Make the values that need a rewrite (decompose sdpa, swap a kernel for states), insert
        the slots, tap the values (and the sources of derived ones), strip the markers and drop
        what no output needs. ``options`` holds per-value options (states' positions, heads, dtype).
        ``rewrite(program)``, if given, runs after those rewrites and before the slots (the decode
        step's cache pass, ``passes.decode``) and returns more nodes to tap, ``{name: Found}``.
        A value asked with ``{"grad": True}`` is also tapped before its view (``grad_tap(name)``), the
        tensor its readers read, so its gradient can be read after a backward."""
        options = options or {}
        self.slots = dict(slots)
        self.extra_inputs = []  # (placeholder name, function of the call's inputs)
        requests = {name: self.catalogue[name].location for name in [*values, *slots]
                    if isinstance(self.catalogue[name].location, OnRequest)}
        done = {}
        for name, request in requests.items():
            if request.node in done:  # scores and probabilities (or both conv sides) of one block: one rewrite
                if request.part in ("states", "state"):
                    raise ValueError(f"'{done[request.node]}' and '{name}': ask a block for states (every token) or "
                                     f"state (at positions), not both; states[:, positions] is the same")
                continue
            done[request.node] = name
            if request.part in ("states", "state"):
                option = options.get(name, {})
                positions, heads = option.get("positions"), option.get("heads")
                swap_for_states(
                    self.graph, request.node,
                    None if positions is None else self._input(f"{name}.positions", _positions(name, positions),
                                                               torch.zeros(len(positions), dtype=torch.long)),
                    None if heads is None else self._input(f"{name}.heads", lambda inputs, h=torch.tensor(heads): h,
                                                           torch.tensor(heads)),
                    option.get("dtype", torch.float32))
            elif request.part == "conv_context":
                open_conv_context(self.graph, request.node)
            else:
                decompose_sdpa(self.graph, request.node)
        if requests:
            self.catalogue = self._catalogue()
        extra_taps = rewrite(self) if rewrite is not None else {}
        slot_nodes = insert_edit_slots(self.graph, {
            name: (self.catalogue[name].location, slot, self.catalogue[name].spec is None)
            for name, slot in slots.items()})

        self.derived = {name: self.catalogue[name] for name in values if self.catalogue[name].derived}
        wanted = [name for name in values if name not in self.derived]
        for entry in self.derived.values():
            wanted += [source for source in self.sources_of(entry) if source not in wanted]
        found = {}
        for name in wanted:
            location = self.catalogue[name].location
            found[name] = Found(slot_nodes[name], location.view) if name in slot_nodes else location
        for name in values:
            if options.get(name, {}).get("grad"):
                found[grad_tap(name)] = Found(found[name].node)
        found.update(extra_taps)
        output = self.graph.output_node()
        model_outputs = len(output.args[0])
        self.tapped = tap(self.graph, found)
        self.returns_logits = logits
        # keep the logits (the model's first output) or none of the model's outputs, and with them
        # drop what only the others needed
        kept = (output.args[0][0],) if logits else ()
        output.args = (kept + tuple(output.args[0])[model_outputs:],)
        strip_markers(self.graph)
        attributes = {node.target: getattr(self.exported.program.graph_module, node.target)
                      for node in self.graph.find_nodes(op="get_attr")}
        # edit slots are pure (an unread one goes too); judged here so the GraphModule compiles its code once
        self.graph.eliminate_dead_code(is_impure_node=lambda node: node.op != "call_module" and node.is_impure())
        self.module = torch.fx.GraphModule({**attributes, **{name_of(n): s for n, s in slots.items()}}, self.graph)
        self.graph.lint()
        self.inputs = _input_sources(self.model, self.exported) + [source for _, source in self.extra_inputs]
        return self

    def _input(self, name: str, source, example: torch.Tensor) -> Node:
        """A new program input after the existing ones, fed by ``source(call inputs)`` and shaped like
        ``example`` (its fake value lets passes infer shapes)."""
        with self.graph.inserting_after(self.graph.find_nodes(op="placeholder")[-1]):
            node = self.graph.placeholder(re.sub(r"\W", "_", name))
        fake_mode = next(n.meta["val"].fake_mode for n in self.graph.find_nodes(op="placeholder")
                         if isinstance(n.meta.get("val"), torch.Tensor))
        node.meta["val"] = fake_mode.from_tensor(example)
        self.extra_inputs.append((node.name, source))
        return node

    @staticmethod
    def sources_of(entry: Entry) -> list[str]:
        """The names a derived value is computed from."""
        return [source.format(host=entry.host) for source in entry.spec.rule.sources]

    def run(self, inputs: dict, eager: bool = False) -> tuple[torch.Tensor | None, dict]:
        """Run on prepared program inputs: (logits or None, {tapped name: tensor}). A compiled
        program runs compiled unless ``eager`` (a call with per-call edits)."""
        module = self.module if eager or self.compiled is None else self.compiled
        with reusing(self.buffers):  # states land in the memory of earlier calls' dropped states
            results = list(module(*[source(inputs) for source in self.inputs]))
        logits = results.pop(0) if self.returns_logits else None
        return logits, dict(zip(self.tapped, results))


def grad_tap(name: str) -> str:
    """The hidden output holding the tensor a ``grad`` value's readers read (before its view)."""
    return f"{name}#grad"


def _input_sources(model, exported: ExportedModel):
    """For each program input, a function of the call's inputs giving its tensor (parameters are the model's)."""
    sources = []
    for spec in exported.program.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            module_path, _, attribute = spec.target.rpartition(".")
            module = model.get_submodule(module_path)
            sources.append(lambda inputs, m=module, a=attribute: getattr(m, a))
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            constant = exported.program.constants[spec.target]
            sources.append(lambda inputs, c=constant: c)
        elif hasattr(spec.arg, "value"):  # a constant argument
            sources.append(lambda inputs, v=spec.arg.value: v)
        else:
            sources.append(lambda inputs, n=spec.arg.name: inputs[n])
    return sources


def _positions(name: str, positions):
    """A function of the call's inputs giving ``positions`` as indices into its tokens."""
    positions = [int(p) for p in positions]

    def source(inputs):
        seq = inputs["input_ids"].shape[1]
        bad = [p for p in positions if not -seq <= p < seq]
        if bad:
            raise IndexError(f"'{name}' positions {bad} are out of range for a call of {seq} tokens")
        return torch.tensor([p % seq for p in positions])
    return source
