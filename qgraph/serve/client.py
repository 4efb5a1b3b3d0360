"""``qgraph.remote(url, api_key)``: a served model with the local API's shape.

    remote = qgraph.remote("http://127.0.0.1:8808", api_key=key)
    ig = remote.instrument(values=["layers.*.layer_output"], edits=["layers.1.layer_output"])
    out = ig(input_ids=ids, attention_mask=mask, edits={"layers.1.layer_output": qgraph.Zero(positions=[-1])})
    out.logits, out["layers.3.layer_output"]
    gen = ig.generate(ids, max_new_tokens=8)

Edits travel as data (``serve/edits.py``); a function edit is exported here and refused here if it cannot
be. A call whose values ask for ``{"grad": True}``, made with gradients on, returns logits that require
grad: ``out.gradients(loss)`` (and ``out.grad(name)`` after ``loss.backward()``) send d loss / d logits
to the server, which runs the backward and returns the values' gradients.
"""
from __future__ import annotations

import torch

from ..errors import InvalidArgument, NotSupported, QgraphError
from ..families import FAMILIES
from ..families.configs import config_of
from ..saved.fields import record, text
from ..saved.schema import FACT_CHECKS
from ..output import Output
from ..sweep import patch_by_calls
from ..values.catalogue import ServedEntry
from ..values.names import aliases, resolve
from .edits import encode
from .wire import parse, pack
from ..generate import GenerateOutput, Step
from ..lens import LogitLens

MEDIA_TYPE = "application/vnd.qgraph.safetensors"


class RemoteError(QgraphError):
    """The server refused or failed a call: ``status`` is its HTTP status, the message its reason."""

    def __init__(self, status: int, message: str):
        super().__init__(f"the server answered {status}: {message}")
        self.status = status


def remote(url: str, api_key: str | None = None, *, timeout: float = 300.0) -> Remote:
    """The model served at ``url`` (``qgraph serve``), called with ``api_key``."""
    return Remote(url, api_key, timeout)


class Remote:
    """A served model: ``info()``, ``instrument(values, edits)``."""

    def __init__(self, url: str, api_key: str | None, timeout: float):
        import httpx
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self._info: dict | None = None  # GET /v1/info's answer, once asked
        self._model: tuple | None = None  # (family, config, catalogue) read from it, once

    def __repr__(self) -> str:
        model = (self._info or {}).get("model", {})
        return f"Remote({self.url}{', ' + model.get('model_type', '') if model else ''})"

    def info(self) -> dict:
        """The model (model type, family, blocks, dtype) and its value catalogue ``{name: layout}``."""
        if self._info is None:
            self._info = self._answer(self._http.get("/v1/info")).json()
        return self._info

    def model(self) -> tuple:
        """``(family, config, catalogue)`` of the served model, read once from ``/v1/info`` (every instrument
        and variant of this server shares them): its family by name, its config rebuilt from the family's
        configuration class, each value's facts checked as a saved program's are (``saved.schema``)."""
        if self._model is None:
            info = self.info()
            model, values = info.get("model"), info.get("values")
            family = next((f for f in FAMILIES if isinstance(model, dict) and f.name == model.get("family")), None)
            if family is None or model is None or model.get("model_type") not in family.model_types \
                    or not isinstance(model.get("config"), dict):
                raise NotSupported(f"the server at {self.url} runs a model of a family or type this qgraph does not "
                                   f"know: use the qgraph the server runs")
            facts = record({**FACT_CHECKS, "dtype": text()})
            if not isinstance(values, dict) or not all(isinstance(name, str) and facts(entry)
                                                      for name, entry in values.items()):
                raise NotSupported(f"the server at {self.url} sends a value catalogue this qgraph does not read: use "
                                   f"the qgraph the server runs")
            catalogue = {name: ServedEntry.of(name, {k: v for k, v in entry.items() if k != "dtype"})
                         for name, entry in values.items()}
            config = config_of(model["model_type"], model["config"])
            if "/" in str(model.get("name") or ""):  # a hub id (a folder is sent by its last part alone): the
                config._name_or_path = model["name"]  # pictures find its tokenizer in this machine's HF cache
            self._model = family, config, catalogue
        return self._model

    def instrument(self, values=(), *, edits=(), logits: bool = True) -> RemoteInstrument:
        """A remote instrument reading ``values`` (names, globs, or ``{name: {"grad": True}}``)."""
        return RemoteInstrument(self, values, edits, logits)

    def run(self, call: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
        """One ``POST /v1/run``: the reply's ``(call, tensors)``."""
        response = self._http.post("/v1/run", content=pack(call, tensors), headers={"Content-Type": MEDIA_TYPE})
        return parse(self._answer(response).content)

    @staticmethod
    def _answer(response):
        if response.status_code != 200:
            try:
                message = response.json()["error"]
            except Exception:  # noqa: BLE001 — not our server's JSON
                message = response.text[:300]
            raise RemoteError(response.status_code, message)
        return response

    def close(self) -> None:
        self._http.close()


class RemoteInstrument:
    """``remote.instrument(...)``: a ``qgraph.Instrument`` whose programs run on the server. Names resolve
    here, by the function a local instrument resolves with (``values.names.resolve``), over the catalogue,
    family and config the server sends (``/v1/info``); calls, ``generate``, the lens and the gradients run
    there."""

    CONCURRENT = 8  # patch's requests in flight at once: the server batches them into a few forwards

    def __init__(self, server: Remote, values, edits, logits: bool):
        self.server, self._values, self._edits, self._logits = server, values, tuple(edits), logits
        self.family, self.config, self.catalogue = server.model()
        self.blocks = len(self.family.block_mixers(self.config))
        self.values = self.resolve(values)

    def __repr__(self) -> str:
        return f"RemoteInstrument({self.server.url}, {len(self.values)} values)"

    device = torch.device("cpu")  # a call's tensors travel from here

    def identity(self) -> dict:
        """The served model's class, name, config and weights as hashes (the server's ``/v1/info``)."""
        return {"model": dict(self.server.info()["model"]["identity"]), "server": self.server.url}

    def resolve(self, patterns) -> list[str]:
        """The value names ``patterns`` select, as a local instrument of the served model selects them."""
        return resolve(patterns, self.catalogue, self.family, self.config) if patterns else []

    def variant(self, values=(), *, edits=(), logits: bool = True) -> RemoteInstrument:
        """An instrument of the same server reading ``values``, with slots at ``edits``."""
        return RemoteInstrument(self.server, values, edits, logits)

    def run_patches(self, clean: dict, corrupt: dict, names: list[str], metric, positions, heads, batch_size):
        """``qgraph.patch``'s locations, one request each, ``CONCURRENT`` in flight (the server batches them)."""
        return patch_by_calls(self, clean, corrupt, names, metric, positions, heads, self.CONCURRENT)

    # -- calls ---------------------------------------------------------------------------------------------
    def _call(self, input_ids, attention_mask, edits) -> tuple[dict, dict]:
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids[None]
        tensors = {"input_ids": ids.long()}
        if attention_mask is not None:
            tensors["attention_mask"] = torch.as_tensor(attention_mask).long()
        call = {"values": self._values if isinstance(self._values, dict) else list(self._values),
                "logits": self._logits}
        if edits:
            specs = {}
            for index, (pattern, edit) in enumerate(self._edit_items(edits)):
                spec, held = encode(pattern, edit, f"edit.{index}", self.server.info()["values"].get(pattern))
                specs[pattern] = spec
                tensors.update(held)
            call["edits"] = specs
        return call, tensors

    def _edit_items(self, edits: dict):
        """``(pattern, edit)``; a function edit's pattern is expanded, each name exported over its own layout."""
        for pattern, edit in edits.items():
            if callable(edit) and not hasattr(edit, "apply"):
                yield from ((name, edit) for name in self.resolve(pattern))
            else:
                yield pattern, edit

    def __call__(self, input_ids=None, attention_mask=None, *, edits=None) -> Output:
        call, tensors = self._call(input_ids, attention_mask, edits)
        reply, got = self.server.run(call, tensors)
        logits = got.get("logits")
        watched = {}
        grads = [name for name, options in self._values.items() if options.get("grad")] \
            if isinstance(self._values, dict) else []
        if grads and logits is not None and torch.is_grad_enabled():
            logits = logits.requires_grad_()
            watched = {name: (got[f"value.{name}"], ()) for name in self.resolve(grads)}
        values = {name: got[f"value.{name}"] for name in reply["values"]}
        return RemoteOutput(logits, values, reply["blocks"], watched, aliases=aliases(self.family, self.config),
                            source=self, input_ids=tensors["input_ids"], request=(self.server, call, tensors),
                            attention_mask=tensors.get("attention_mask"), edits=edits)

    def generate(self, input_ids=None, attention_mask=None, *, max_new_tokens: int | None = None, edits=None,
                 steps=None, **settings):
        """Generate on the server (greedy, or ``do_sample=True`` with ``seed=``): a local ``GenerateOutput``."""
        call, tensors = self._call(input_ids, attention_mask, edits)
        settings = {key: value for key, value in settings.items() if value is not None}
        if max_new_tokens is not None:
            settings["max_new_tokens"] = max_new_tokens
        if steps is not None:
            settings["steps"] = list(steps)
        call["generate"] = settings
        reply, got = self.server.run(call, tensors)
        out = GenerateOutput(got["sequences"])
        for step in range(reply["steps"]):
            prefix = f"step.{step}.value."
            values = {key[len(prefix):]: tensor for key, tensor in got.items() if key.startswith(prefix)}
            out.steps.append(Step(values, got[f"step.{step}.logits"], self.blocks))
            if f"step.{step}.scores" in got:  # a step that chose a new token (the last token's runs for values)
                out.logits.append(got[f"step.{step}.logits"])
                out.scores.append(got[f"step.{step}.scores"])
        return out

    def logit_lens(self, input_ids, attention_mask=None, *, positions="all", top: int = 5, logits: bool = False):
        """What ``ig.logit_lens`` returns, the projection on the vocabulary run on the server."""
        if isinstance(positions, (tuple, range)):
            positions = list(positions)
        _, tensors = self._call(input_ids, attention_mask, None)
        reply, got = self.server.run({"lens": {"positions": [positions] if isinstance(positions, int) else positions,
                                               "top": top, "logits": logits}}, tensors)
        return LogitLens(got["lens.ids"], got["lens.probabilities"], reply["positions"], tensors["input_ids"], self,
                         logits=got.get("lens.logits"), attention_mask=tensors.get("attention_mask"))


class RemoteOutput(Output):
    """A remote call's ``Output``; its gradients come from the server (one more request, with d loss / d logits)."""

    def __init__(self, logits, values, blocks, watched, *, aliases, source, input_ids, request, attention_mask=None,
                 edits=None):
        super().__init__(logits, values, blocks, watched, aliases=aliases, source=source, input_ids=input_ids,
                         attention_mask=attention_mask, edits=edits)
        self._request = request

    def gradients(self, loss: torch.Tensor, names=None) -> dict[str, torch.Tensor]:
        keys = [self._watched(name) for name in (names if names is not None else self.watched)]
        (grad,) = torch.autograd.grad(loss, [self._logits()], materialize_grads=True)
        return self._server_grads(grad, keys)

    def grad(self, name: str) -> torch.Tensor:
        key = self._watched(name)
        logits = self._logits()
        if logits.grad is None:
            raise InvalidArgument(f"no gradient has reached the logits yet: call backward() on a loss computed from "
                                  f"out.logits first, then out.grad('{name}')")
        return self._server_grads(logits.grad, [key])[key]

    def _logits(self) -> torch.Tensor:
        """The logits, where the server's backward starts (a value is watched only in a call that returned them)."""
        if self.logits is None:
            raise InvalidArgument("this call returned no logits (logits=False), where the server's gradients start: "
                                  "instrument with logits=True to read gradients")
        return self.logits

    def _server_grads(self, grad: torch.Tensor, keys: list[str]) -> dict[str, torch.Tensor]:
        server, call, tensors = self._request
        reply, got = server.run({**call, "backward": "logits.grad"}, {**tensors, "logits.grad": grad.detach()})
        return {key: got[f"grad.{key}"] for key in keys}
