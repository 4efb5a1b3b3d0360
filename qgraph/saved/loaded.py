"""A loaded program (``qgraph.load``): a ``qgraph.Instrument`` whose graph was built from a saved file.

It answers calls as the instrumented model did (an ``Output`` with the logits and the values it was saved
with, ``edits={name: edit}`` at its slots), resolves names over the catalogue facts its file holds, and runs
the recipes and pictures through the interface (``variant``, ``run_patches``).
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import direct
from ..errors import InvalidArgument, InvalidState, InvalidType, NotSupported, QgraphError, SavedProgramError
from ..edits import EditError, Replace, Target, needs
from ..families import FAMILIES
from ..families.configs import config_of
from ..export.watch import ModelWatch
from ..identity import config_sha256, tensors_sha256
from ..inputs import check_text
from ..lens import LogitLens, logit_lens
from ..output import Output
from ..kernels.slot import editing
from ..rewrites.on_request import input_source
from ..values import derive
from ..sweep import patch_by_calls
from ..values.catalogue import ServedEntry
from ..values.names import aliases, resolve
from . import sandbox
from .write import META

from .allowed import FRESH
from .feed import weights_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class LoadedProgram:
    """A saved instrumented program, a ``qgraph.Instrument``: call it like the instrumented model
    (``input_ids``, ``attention_mask``, ``edits={name: edit}`` at the slots it was saved with). Its
    catalogue holds the values and slots it was saved with; names resolve over it as an instrumented
    model's do (``values.names.resolve``), and ``variant`` reads some of its values (``{"grad": True}``
    keeps a value's gradient: the weights run as leaves of autograd), so the recipes and pictures run on it."""

    def __init__(self, path: Path, module: torch.fx.GraphModule, inputs: list, meta: dict, weights: dict,
                 model: PreTrainedModel | None = None, bounds: sandbox.Bounds | None = None):
        self.path, self.module, self.meta, self._bounds = path, module, meta, bounds
        self.values: list[str] = meta["values"]
        self.slots: dict[str, Target] = {name: Target(name, slot["layout"], tuple(slot["dims"]))
                                         for name, slot in meta["slots"].items()}
        self._views = {name: tuple(tuple(step) for step in slot["view"]) for name, slot in meta["slots"].items()}
        self._extra = [input_source(recipe) for recipe in meta["inputs"]]
        self._inputs = inputs  # per graph input: {"parameter": name} or {"input": index} (checked: saved.schema)
        # the messages of the graph's assertions of a fixed edit's needs (saved.inline): a call they refuse
        # is an EditError, as the instrumented model's own refusal is
        asserts = module.graph.find_nodes(op="call_function", target=torch.ops.aten._assert_scalar.default)
        self._needs = {node.args[1] for node in asserts if isinstance(node.args[1], str) and node.args[1]}
        self._model = model  # weights=model: followed (see _follow)
        self._use(weights)
        self.config = _config(path, meta)
        self.family = next(family for family in FAMILIES if family.name == meta["family"])  # schema: one of them
        self.blocks = meta["blocks"]
        self.catalogue = {name: ServedEntry.of(name, facts) for name, facts in meta["catalogue"].items()}
        self._logits = meta["logits"]  # whether its calls return the logits (a variant's may not)
        self._watch: tuple[str, ...] = ()  # values whose gradients a variant's calls keep ({"grad": True})
        # the values it returns that the rest of the graph reads too, as tensors of their own (not a view of what
        # the graph reads: allowed.FRESH): d loss / d value is the returned tensor's gradient
        returned = module.graph.output_node().args[0][int(meta["logits"]):]
        self._read = {name for name, node in zip(meta["outputs"], returned)
                      if isinstance(node, torch.fx.Node) and len(node.users) > 1 and str(node.target) in FRESH}

    def _use(self, weights: dict) -> None:
        """Feed the program ``weights`` (``{name: function giving the tensor}``) and the call's inputs."""
        seen = None if self._model is None else ModelWatch(self._model)
        self._sources = [weights[item["parameter"]] if "parameter" in item else item["input"] for item in self._inputs]
        self._anchor = next(iter(weights.values()), None)  # any weight: where they are
        self._weights = weights
        self._seen = seen  # the model as its weights were read

    def _follow(self) -> None:
        """Read the model's parameters again if it changed since they were read (a replaced submodule,
        untied weights, another dtype or device), as ``InstrumentedModel.refresh`` does; weights that
        no longer fit are refused by name."""
        if self._seen is not None and not self._seen.holds():
            self._use(weights_of(self.path, self.meta, self._model))

    def work(self, batch: int = 1, length: int = 1) -> float:
        """The floating-point operations a call of ``batch`` prompts of ``length`` tokens does, as the
        sandbox counts them from the graph (contractions' multiply-adds twice, other ops their elements)."""
        ids = torch.empty(batch, length, dtype=torch.long)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        user = [ids, inputs["attention_mask"], *(source(inputs) for source in self._extra)]
        shapes = [user[source].shape if isinstance(source, int) else () for source in self._sources]
        if self._bounds is None:
            raise InvalidState("this program was made without the bounds qgraph.load checks, so its work is unknown: "
                               "load it with qgraph.load(path)")
        return self._bounds.work_at(shapes)

    @property
    def graph(self) -> torch.fx.Graph:
        """The loaded program's ``torch.fx`` graph (what ``qgraph.render`` draws)."""
        return self.module.graph

    def __call__(self, input_ids=None, attention_mask=None, *, edits: Mapping | None = None) -> Output:
        self._follow()
        device = self._anchor().device if self._anchor is not None else torch.device("cpu")
        input_ids, attention_mask = check_text(input_ids, attention_mask, self.meta["vocab_size"], device)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        user = [input_ids, attention_mask, *(source(inputs) for source in self._extra)]
        args = [user[source] if isinstance(source, int) else source() for source in self._sources]
        if self._bounds is not None:
            self._bounds.check(args)
        watching = bool(self._watch) and torch.is_grad_enabled()
        if watching:  # the weights as leaves of autograd (not copied; the model's own untouched): the values
            # carry gradients, and out.gradients asks for theirs alone (no weight's gradient is computed)
            args = [arg.detach().requires_grad_() if not isinstance(source, int) and isinstance(arg, torch.Tensor)
                    and arg.is_floating_point() else arg for source, arg in zip(self._sources, args)]
        with editing(self._edits(edits)):
            try:
                results = list(direct.forward(self.module)(*args))  # each op at its entry point (qgraph.direct)
            except IndexError as error:  # an index its graph computes past a tensor's end: the file's doing
                raise SavedProgramError(f"{self.path.name} indexes past the end of a tensor at this call "
                                        f"({str(error).splitlines()[0][:200]}): a program ig.save writes does not, so "
                                        f"the file was changed after it was saved; save it again from the model"
                                        ) from None
            except RuntimeError as error:
                need = next((need for need in self._needs if need in str(error)), None)
                if need is None:
                    raise
                raise EditError(f"{need}; this call has {input_ids.shape[1]} tokens") from None
        logits = results.pop(0) if self.meta["logits"] else None
        captured = dict(zip(self.meta["outputs"], results))
        derive.fill(captured, {name: (rule["how"], rule["sources"]) for name, rule in self.meta["derived"].items()},
                    inputs, self.config)
        values = {name: captured[name] for name in self.values if name in captured}
        watched = {name: (captured[name], ()) for name in self._watch} if watching else {}
        return Output(logits if self._logits else None, values, self.blocks, watched,
                      aliases=aliases(self.family, self.config), source=self, input_ids=input_ids,
                      attention_mask=attention_mask, edits=edits)

    def weights(self) -> dict[str, Callable[[], torch.Tensor]]:
        """``{export target: a function giving the tensor}`` of the weights its program reads
        (``model.norm.weight``): what ``out.logit_attribution`` reads the projections and the head from."""
        self._follow()
        return dict(self._weights)

    @property
    def device(self) -> torch.device:
        """Where its calls take their inputs: its weights' device."""
        return self._anchor().device if self._anchor is not None else torch.device("cpu")

    def identity(self) -> dict:
        """Its model's class and config, and the weights it reads, as hashes (``qgraph.identity``)."""
        self._follow()
        read = [(name, self._weights[name]()) for name in sorted(self._weights)]
        return {"model": {"class": self.meta["model_class"], "name": self.path.name,
                          "config_sha256": config_sha256(self.meta["config"]), "weights_sha256": tensors_sha256(read)}}

    def resolve(self, patterns) -> list[str]:
        """The names of its values and slots that ``patterns`` select, as an instrumented model selects them."""
        return resolve(patterns, self.catalogue, self.family, self.config) if patterns else []

    def variant(self, values=(), *, edits=(), logits: bool = True) -> LoadedProgram:
        """This program returning ``values`` (some of those it was saved with), editable at ``edits`` (some
        of its slots): what the recipes run."""
        names, slots = self.resolve(values), self.resolve(list(edits))
        watch = [name for pattern, options in (values.items() if isinstance(values, Mapping) else ())
                 if (options or {}).get("grad") for name in self.resolve(pattern)]
        unread = [name for name in watch if name in self.values and name not in self._read]
        if unread:
            raise NotSupported(f"{self.path.name} returns {', '.join(unread[:4])} as a view the rest of its graph does "
                               f"not read, so no gradient of it can be read here: read it with "
                               f"qgraph.instrument(model) or on a server")
        lacking = [name for name in names if name not in self.values] + \
            [name for name in slots if name not in self.slots]
        if lacking:
            raise NotSupported(f"{self.path.name} was saved without {', '.join(lacking[:4])} among its values and "
                               f"slots (values {self.values}, slots {list(self.slots)}): save a program that has them "
                               f"(instrument(model, values=..., edits=[...]).save(path))")
        if logits and not self.meta["logits"]:
            raise NotSupported(f"{self.path.name} was saved with logits=False: save it with logits")
        view = copy.copy(self)
        view.values, view._logits = [name for name in names if name in self.values], logits
        view._watch = tuple(dict.fromkeys(watch))
        return view

    def run_patches(self, clean: dict, corrupt: dict, names: list[str], metric, positions, heads, batch_size) -> dict:
        """``qgraph.patch``'s locations, one call each (a saved program is not cut into blocks)."""
        return patch_by_calls(self, clean, corrupt, names, metric, positions, heads)

    def generate(self, *args, **kwargs):
        """Refused: a saved program is one forward pass, without the cache generation decodes from."""
        raise NotSupported(f"{self.path.name} is one forward pass, saved without a cache: generate with "
                           f"qgraph.instrument(model) or on a server (qgraph serve)")

    def logit_lens(self, input_ids, attention_mask=None, *, positions="all", top: int = 5,
                   logits: bool = False) -> LogitLens:
        """What ``InstrumentedModel.logit_lens`` returns, projected by ``project_on_vocab``: a program saved
        with every block's ``layer_output`` among its values and a slot at the last block's."""
        return logit_lens(self, input_ids, attention_mask, positions, top, logits)

    def project_on_vocab(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of a residual-stream tensor by the program's own readout: the last block's output replaced
        by ``hidden`` (its slot must have been saved), so the final norm and head the program runs project it
        (the blocks before run on placeholder tokens; their result is replaced)."""
        last = f"layers.{self.blocks - 1}.layer_output"
        if last not in self.slots or not self.meta["logits"]:
            raise NotSupported(f"{self.path.name} projects on the vocabulary through its own readout, which needs a "
                               f"slot at {last} and the logits: save it with instrument(model, edits=['{last}']) "
                               f"(logits=True), or read the lens with qgraph.instrument(model) or on a server")
        width = self.config.get_text_config().hidden_size
        if not isinstance(hidden, torch.Tensor) or hidden.dim() == 0 or hidden.shape[-1] != width:
            got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise InvalidArgument(f"project_on_vocab takes a residual-stream tensor [..., {width}], got {got}")
        rows = hidden.reshape(1, -1, width)
        tokens = torch.zeros(rows.shape[:2], dtype=torch.long, device=hidden.device)
        logits = self.variant((), edits=[last])(tokens, edits={last: Replace(rows)}).logits
        assert logits is not None, "a variant with logits of a program saved with them returns them"
        return logits.reshape(*hidden.shape[:-1], logits.shape[-1])

    def _edits(self, edits: Mapping | None) -> dict:
        if edits is None:
            return {}
        if not isinstance(edits, Mapping):
            raise InvalidType(f"edits= takes a dict {{name: edit}}, not {type(edits).__name__}")
        chosen = {}
        for pattern, edit in edits.items():
            try:
                names = self.resolve(pattern)
            except QgraphError:
                names = []
            if not names or any(name not in self.slots for name in names):
                raise EditError(f"{pattern!r} is not an edit slot of {self.path.name}; its slots are "
                                f"{', '.join(self.slots) or 'none'} (declare slots with instrument(..., edits=[...]) "
                                f"before saving)")
            if needs(edit):
                raise EditError(f"{type(edit).__name__} at {pattern!r} reads {list(needs(edit))} of the forward, and a "
                                f"loaded program's slots read only their own value: fix the edit into the program "
                                f"before saving (instrument(model, edits={{name: edit}}).save(path)), or run it on the "
                                f"instrumented model")
            for name in names:
                chosen[name] = (edit, self.slots[name], self._views[name])
        return chosen

    def __repr__(self) -> str:
        return (f"LoadedProgram({self.path.name}: {self.meta['model_class']}, {len(self.values)} values, "
                f"slots {list(self.slots)})")


def _config(path: Path, meta: dict):
    """The model's config, rebuilt from its class's configuration file (never its modeling file)."""
    try:
        return config_of(meta["model_type"], meta["config"])
    except Exception as error:  # noqa: BLE001 (any refusal of the config's fields is the file's)
        raise SavedProgramError(f"{path} ({META}): its field 'config' is not a {meta['model_type']} config "
                                f"({type(error).__name__}: {str(error)[:200]})") from None
