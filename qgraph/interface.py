"""``qgraph.Instrument``: what every door to a model gives, wherever its program runs.

Three classes implement it:

- ``qgraph.instrument(model, ...)`` (``InstrumentedModel``): the program runs here, by the runner its
  build chose (``qgraph.runners``: eager, compiled or staged);
- ``qgraph.remote(url).instrument(...)`` (``serve.client.RemoteInstrument``): it runs on a server;
- ``qgraph.load(path)`` (``saved.loaded.LoadedProgram``): a saved program runs here, with no model class.

Each has a ``catalogue`` (``{name: entry}``: ``layout``, ``dims``, ``shape``, ``description``, ``host``,
``port``, ``available``; a local ``Entry``, or the same facts sent as data, ``values.catalogue.ServedEntry``),
the model's ``family``, ``config`` and ``blocks``, and resolves names with one function
(``values.names.resolve``) over them, so a name or glob selects the same values in the same order
wherever the model runs. The recipes (``patch``, ``attribution_patch``, ``steer``, ``logit_lens``), the
pictures (``out.plot``, ``qgraph.explore``) and ``qgraph.capture`` are written once against this protocol.
What one door cannot do it refuses by name, with the door that can (a saved program does not generate).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Instrument(Protocol):
    """A model's forward with values to read and slots to edit (see the module's docstring)."""

    family: Any  # the model's family (qgraph.families.Family): its rules, read on ``config``
    config: Any  # the model's transformers config
    catalogue: Mapping[str, Any]  # every value it knows: {name: entry}
    values: list[str]  # the values its calls return

    @property
    def blocks(self) -> int:
        """The model's decoder blocks."""
        ...

    @property
    def device(self) -> Any:
        """Where its calls take their inputs (a ``torch.device``)."""
        ...

    def identity(self) -> dict:
        """What it runs, as hashes (``qgraph.identity``): a capture records it, to refuse mixing shards."""
        ...

    def resolve(self, patterns) -> list[str]:
        """The value names ``patterns`` select (names, globs, ``layers[-1]``, TransformerLens and HF names)."""
        ...

    def variant(self, values=(), *, edits=(), logits: bool = True) -> Instrument:
        """An instrument of the same model, run the same way, reading ``values`` with slots at ``edits``."""
        ...

    def __call__(self, input_ids=None, attention_mask=None, *, edits=None):
        """One forward: an ``Output`` with the logits and the values (``edits={name: edit}`` at its slots)."""
        ...

    def generate(self, input_ids=None, attention_mask=None, **settings):
        """Generate, capturing the values at every step: a ``GenerateOutput``."""
        ...

    def logit_lens(self, input_ids, attention_mask=None, *, positions="all", top: int = 5, logits: bool = False):
        """The logit lens, blocks × positions (every position unless ``positions``): a ``LogitLens``."""
        ...

    def run_patches(self, clean: dict, corrupt: dict, names: list[str], metric, positions, heads,
                    batch_size) -> dict:
        """``qgraph.patch``'s result for ``names``, each location patched the way this instrument runs best
        (a sweep that cuts the program at its blocks here; one request per location on a server)."""
        ...
