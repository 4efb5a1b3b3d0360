"""``qgraph.instrument``: one exported program per model, tapped for the values asked for."""
from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from .errors import InvalidArgument, InvalidType, NotSupported
from .values import derive
from .values.catalogue import Entry
from .compat import hooked_modules
from .compile import compile_options, compile_program
from .edits import EditError, needs
from .export import export_model
from .families import family_for
from .export.watch import ModelWatch
from .identity import model_identity, saes_identity
from .inputs import image_keys, input_embedding, prepare, vision_given
from .values.names import aliases, resolve
from .output import Output, retain
from .passes.edit import EditSlot, applying
from .slots import Slots
from .program import Program
from .kernels import heap
from .runners import Staged
from .values.options import check_options
from .values.support import annotated_tree
from .saes.splice import check_saes, check_transcoders
from .distributed import Stages, stage_program
from .distributed.weights import load_weights
from .generate import generate
from .lens import project_on_vocab, logit_lens

if TYPE_CHECKING:  # a type only: transformers is imported with the model
    from transformers import PreTrainedModel


def instrument(model: PreTrainedModel, values=(), *, edits=(), logits: bool = True, compile=False,
               saes=None, splice: str = "error", transcoders=None, stages=None) -> InstrumentedModel:
    """Export ``model`` (once; later calls reuse it) and tap ``values`` as extra program outputs.

    ``values`` takes names, globs (``layers.*.layer_output``; ``*`` stays within one dotted part,
    ``**`` crosses them), the bracket form (``layers[3].self_attn.attention_scores``), TransformerLens
    hook names (``blocks.3.hook_resid_post``) and HF module paths (``model.layers.3.mlp.output``), as do
    ``edits`` and ``saes`` (values stay named by their standard names); a dict
    ``{name: options}`` also passes options (``{"layers.0.linear_attn.state": {"positions": [0, -1]}}``;
    ``states`` and ``state`` take ``dtype=`` and ``heads=`` too).
    ``edits`` declares edit slots: a list of names (edits given per call, ``ig(..., edits={...})``)
    or a dict ``{name: edit}`` of edits fixed into the program. With ``logits=False`` the program
    returns only the captured values, and what only the logits needed (``lm_head``, blocks past the
    last value) is not computed. ``compile=True`` (or a dict of ``torch.compile`` options) runs the
    program under ``torch.compile`` (see ``InstrumentedModel.compile``). ``saes={value: sae}`` splices
    sparse autoencoders (``qgraph.SAE``) at values, with values ``<value>.sae.features`` /
    ``.reconstruction`` / ``.error`` (``<block>.sae.*`` too where the block has one SAE);
    ``transcoders={block: transcoder}`` splices transcoders (``qgraph.Transcoder``) across blocks' MLPs
    (values ``layers.{i}.transcoder.*``); ``splice="reconstruction"`` makes the model read the
    reconstructions instead of the values (the default, "error", keeps the values exact).
    ``stages=N`` (or a list of the blocks that start stages 1, 2, ..., or ``qgraph.Stages(...)`` with
    micro-batches, torch's schedule, devices) cuts the program at block boundaries into stages: under
    torchrun one stage per rank on torch's pipeline engine, each returning its own values (see
    ``qgraph.distributed``); otherwise all in this process (each on its device with ``devices=``).
    """
    options = compile_options(compile)
    if stages is not None and options is not None:
        raise InvalidArgument("stages= runs each stage eagerly; drop compile= (or instrument without stages)")
    instrumented = InstrumentedModel(model, values, edits=edits, logits=logits, saes=saes, splice=splice,
                                     transcoders=transcoders, stages=stages)
    return instrumented if options is None else instrumented.compile(**options)


class InstrumentedModel:
    """A model's forward as a graph whose outputs include the values asked for.

    Call it like the model (``ig(input_ids=..., attention_mask=...)``, ``ig(**tokenizer(...))`` or,
    on the image-text model, ``ig(**processor(text=..., images=..., return_tensors="pt"))``), with
    ``edits={name: edit}`` at any value; it returns an ``Output``. ``loss=fn`` (logits to a scalar)
    runs the backward of ``fn(logits)`` too (through every stage, across processes as well):
    parameters get ``.grad``, ``out.grad(name)`` answers and ``out.loss`` is its value. The model's
    parameters are read at call time, never copied. A call with edits at values that have no declared
    slot runs a program with those slots, built on first use and kept for the next call with the same set.
    When the model changes in a way the program depends on (a replaced submodule, untied weights,
    another dtype or device, another attention implementation), the next call rebuilds the programs.

    It is a ``qgraph.Instrument`` (``qgraph/interface.py``): what the recipes and pictures use of it. Other
    qgraph modules use its ``program_for`` (the built program of a kind of call), ``slot``, ``decoder``
    (generation's programs) and ``use_weights`` (weights loaded for a model on meta) too.
    """

    def __init__(self, model: PreTrainedModel, values=(), *, edits=(), logits=True, saes=None, splice="error",
                 transcoders=None, stages=None):
        family_for(model)  # an unsupported model (or not a model at all) is named before anything else
        if not isinstance(logits, bool):
            raise InvalidType(f"logits= takes True or False, not {logits!r}")
        self.model, self.config = model, model.config
        self._request, self._logits = (values, edits), logits
        self._compile: dict | None = None  # torch.compile's options, once compiled (``compile``)
        self._sae_request, self._transcoder_request = (saes or {}, splice), (transcoders or {}, splice)
        self._stages = Stages.of(stages)
        # tensors loaded for a model on meta (load_weights), and where
        self._weights: dict[str, torch.Tensor] = {}
        self._device: torch.device | None = None
        self._lock = threading.RLock()  # builds programs; calls themselves run unlocked
        self._variants: dict[tuple, InstrumentedModel] = {}  # what the helpers run (``variant``)
        self._decoders: dict[tuple, object] = {}  # generation's programs (``decoder``)
        self._build()
        hooked = [self.family.module_name(path) or path for path in hooked_modules(model)]
        if hooked:
            warnings.warn(f"qgraph: the hooks registered on {', '.join(hooked[:4])}{' ...' if len(hooked) > 4 else ''} "
                          f"do not run in the instrumented program (it is exported without them); use edits= to "
                          f"change values, values= to read them", stacklevel=3)

    def _build(self) -> None:
        """Export (or reuse the export of) the model and build the program for the values and slots asked."""
        self.exported = export_model(self.model)
        self._reads = set(self.exported.reads)  # the values the programs baked in, read by every fingerprint
        self._watch = ModelWatch(self.model, self._reads)  # what refresh checks the model against
        self.family = self.exported.family
        self._blocks = len(self.family.block_mixers(self.config))  # as built: a change the programs read rebuilds
        main = Program(self.model, self.exported, weights=self._weights, device=self._device)
        self.catalogue: dict[str, Entry] = main.catalogue
        self.saes = check_saes(self._sae_request, self.resolve, main.catalogue)
        self.transcoders = check_transcoders(self._transcoder_request, main.catalogue, self.saes)
        if self.saes or self.transcoders:
            main = self._program(self.exported)
            self.catalogue = main.catalogue
        values, edits = self._request
        self.values = self.resolve(values)
        self.options = self.check_options(values)
        self._slots = Slots(self.catalogue, self.resolve, edits, self._lock)
        self.slots: dict[str, EditSlot] = self._slots.declared
        self._programs: dict[tuple, Program] = {}
        self._decoders = {}  # generation's programs (``decoder``), of the model as it was
        self._check_stages()
        self._programs[self._key(self.exported.images)] = main.build(self.values, self.slots, self._logits,
                                                                     self.options)
        self.catalogue = main.catalogue  # as built: a decomposed block's pattern is now found
        self._slots.catalogue = self.catalogue  # slots made per call read the catalogue as built, as before
        self._finish(self._programs[self._key(self.exported.images)])

    def _finish(self, program: Program, extra=()) -> None:
        """Split a built program into its stages, or compile it (a program with per-call slots runs eagerly)."""
        if self._stages is not None:
            program.runs_on(Staged(stage_program(program, self._stages)))
        elif self._compile is not None and not extra:
            compile_program(program, **self._compile)

    def _check_stages(self) -> None:
        if self._stages is None or self._stages.microbatches == 1:
            return
        unbatched = [name for name in self.values if self.catalogue[name].shape[:1] != ("batch",)]
        if unbatched:
            raise InvalidArgument(f"micro-batches cut the batch, but {', '.join(unbatched[:3])} have no leading batch "
                                  f"dim ({self.catalogue[unbatched[0]].layout}): use microbatches=1 or leave them out")

    def _key(self, images: bool, extra: Mapping[str, tuple] | None = None) -> tuple:
        """A program's key: the image-text program or not, and its slots, each with the values it reads."""
        return images, self._slots.key(extra)

    @property
    def blocks(self) -> int:
        """The model's decoder blocks (counted when the programs were built, as a saved or served door counts
        them once)."""
        return self._blocks

    @property
    def device(self) -> torch.device:
        """Where its calls take their inputs: the embedding's device (or the loaded weights')."""
        return self._device or input_embedding(self.model).weight.device

    def identity(self) -> dict:
        """The model's class, name, config and weights as hashes, and its SAEs' (``qgraph.identity``)."""
        return {"model": model_identity(self.model), **({"saes": saes_identity(self.saes)} if self.saes else {})}

    def check_options(self, values) -> dict[str, dict]:
        """Per-value options from ``values={name: {option: ...}}``, checked (``values.options``)."""
        return check_options(values, self.resolve, self.catalogue, self.values)

    def resolve(self, patterns) -> list[str]:
        """The value names that ``patterns`` (names, globs, bracket forms; a list or one string) select."""
        return resolve(patterns, self.catalogue, self.family, self.config) if patterns else []

    @property
    def program(self) -> torch.fx.GraphModule:
        """The runnable program (of the image-text program on the image-text model)."""
        return self.program_for(self.exported.images).module

    @property
    def graph(self) -> torch.fx.Graph:
        """The program's graph, taps and slots included (markers already removed)."""
        return self.program.graph

    # -- what other qgraph modules use (generate, save, load_weights, the recipes) ---------------------
    def program_for(self, images: bool, extra: Mapping[str, tuple] | None = None) -> Program:
        """The program a call runs: a text-only call to the image-text model runs its text program;
        a call with edits at undeclared values, or reading more of the forward (``extra``: ``{name: the
        values its edit reads}``), one that also has those slots."""
        key = self._key(images, extra)
        program = self._programs.get(key)
        if program is not None:
            return program
        with self._lock:
            if key not in self._programs:
                exported = export_model(self.model, images=images)
                if not exported.reads <= self._reads:
                    self._reads |= exported.reads
                    self._watch = ModelWatch(self.model, self._reads)
                program = self._program(exported)
                present = program.present
                slots = {name: self.slot(name, reads) for name, reads in key[1] if name in present}
                self._programs[key] = program.build([n for n in self.values if n in present], slots, self._logits,
                                                    {n: o for n, o in self.options.items() if n in present})
                self._finish(self._programs[key], extra)
            return self._programs[key]

    def _program(self, exported) -> Program:
        """A program builder for ``exported``, with this model's SAEs and transcoders."""
        return Program(self.model, exported, self.saes, self._weights, self._device, self.transcoders)

    def slot(self, name: str, reads: tuple = ()) -> EditSlot:
        """The slot at ``name`` that reads ``reads``: declared, or made for per-call edits (``slots.Slots``)."""
        return self._slots.get(name, reads)

    def decoder(self, key, make):
        """Generation's programs for ``key`` (its values and edits): ``make()`` once, then kept until the
        model changes (``refresh`` drops them with the other programs)."""
        with self._lock:
            if key not in self._decoders:
                self._decoders[key] = make()
            return self._decoders[key]

    def use_weights(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        """Run the programs on ``tensors`` (parameter and buffer targets of the export: weights loaded
        for a model built on ``meta``) on ``device``, instead of the model's own; rebuilds them."""
        with self._lock:
            self._weights.update(tensors)
            self._device = device
            self._build()

    def variant(self, values=(), *, edits=(), logits: bool = True) -> InstrumentedModel:
        """An instrument of the same model that runs as this one does (its SAEs, their splice and its
        fixed edits) and reads ``values``, with slots at ``edits`` (names); what ``patch``,
        ``attribution_patch``, ``logit_lens`` and ``top_features`` run. Kept for the next ask."""
        key = (repr(values), tuple(edits), logits)
        with self._lock:
            if key not in self._variants:
                requested = self._request[1]
                fixed = dict(requested) if isinstance(requested, Mapping) else {}
                self._variants[key] = InstrumentedModel(
                    self.model, values, edits={**dict.fromkeys(self.resolve(list(edits))), **fixed},
                    logits=logits, saes=self._sae_request[0], splice=self._sae_request[1],
                    transcoders=self._transcoder_request[0])
            return self._variants[key]

    def run_patches(self, clean: dict, corrupt: dict, names: list[str], metric, positions, heads, batch_size) -> dict:
        """``qgraph.patch``'s locations, as a sweep that runs the corrupt prefix once (``qgraph.sweep``)."""
        from .sweep import sweep  # lazy: patching sweeps (and the stage cutting they use) load with the first patch
        return sweep(self, clean, corrupt, names, metric, positions, heads, batch_size)

    def compile(self, **options) -> InstrumentedModel:
        """Run the program(s) under ``torch.compile`` (``fullgraph=True`` unless ``options`` say
        otherwise), one block of each kind compiled and reused for the blocks that repeat; returns self.
        The first call compiles; the batch and sequence dims are dynamic, so a new prompt length does not
        recompile. A call with per-call edits runs the eager program (see ``qgraph.compile``)."""
        self._compile = options
        for (_, slots), program in self._programs.items():
            if slots == self._slots.main:
                compile_program(program, **options)
        return self

    def release_buffers(self) -> None:
        """Give back the memory kept from earlier calls' states and values. A program that captures
        states keeps the memory of the states you have dropped and writes the next call's states
        there (on CPU, fresh memory costs more to fill than the states cost to compute); tensors you
        still hold are never reused. Deleting the instrumented model releases the states' memory
        too. The C heap the values grew is kept for the process's next call (``kernels.heap``):
        this gives it back as well."""
        for program in self._programs.values():
            program.buffers.release()
        heap.release()

    # -- running ---------------------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 *, edits: Mapping | None = None, loss=None, **inputs) -> Output:
        self.refresh()
        given = [key for key in image_keys(self.family) if inputs.get(key) is not None]
        if not self.exported.images and given:
            raise InvalidType(f"{type(self.model).__name__} is text-only and takes no images ({', '.join(given)}): "
                              f"load the image-text model (one of {self.family.classes})")
        images = self.exported.images and vision_given(inputs)  # images, videos or both: the image-text program
        prepared = prepare(self.model, self.family.images, input_ids, attention_mask, with_images=images, **inputs)
        call_edits = self.call_edits(edits)
        program = self.program_for(images, {name: needs(edit) for name, edit in call_edits.items()})
        missing = [name for name in call_edits if name not in program.slots]
        if missing:
            raise EditError(f"{missing} are not in this call's program: a call without images has no vision values")
        watched = [name for name in program.tapped if name.endswith("#grad")]
        with applying({program.slots[name]: edit for name, edit in call_edits.items()}):
            ran = program.run(prepared, eager=bool(call_edits) or bool(watched) or loss is not None, loss=loss)
        logits, captured = ran[:2]
        derive.fill(captured, program.derivations, prepared, self.config)  # not those whose sources are on another rank
        values = {name: captured[name] for name in self.values if captured.get(name) is not None}
        grads = {}
        for key in watched:
            name, tensor = key[:-5], captured[key]
            if tensor is None:  # computed on another rank
                continue
            retain(tensor)  # a tensor, or its micro-batches' (stages in this process)
            grads[name] = (tensor, program.catalogue[name].found.view)  # tapped, so found
        return Output(logits, values, self.blocks, grads, aliases=aliases(self.family, self.config), source=self,
                      input_ids=prepared["input_ids"], attention_mask=prepared["attention_mask"], edits=edits,
                      loss=ran[2] if loss is not None else None)

    def call_edits(self, edits: Mapping | None) -> dict[str, object]:
        """``{name: edit}`` for a call's ``edits={pattern: edit}``: names resolved and checked, reads named
        (``slots.Slots.of_call``)."""
        return self._slots.of_call(edits)

    def refresh(self) -> None:
        """Rebuild the programs if the model changed since they were built (a replaced submodule,
        untied or retied weights, another dtype, device or attention implementation, or a plain value
        the program baked in: a norm's eps, an attention's scaling, a config field). Every call
        does this first: a cheap exact check of what the model's fingerprint is computed from
        (``export.watch.ModelWatch``), the fingerprint itself where that check sees a difference."""
        if not self._watch.holds():
            with self._lock:
                if not self._watch.holds():
                    self._weights.clear()  # weights loaded for the model as it was (load_weights) would be stale
                    self._device = None
                    self._build()

    def load_weights(self, checkpoint, device=None) -> list[str]:
        """Read the weights of a model built on the ``meta`` device from ``checkpoint`` (a safetensors
        file or a folder of them) onto ``device`` (the CPU by default; with ``Stages(devices=...)`` each
        stage's onto its device): only the parameters and buffers this process's stage reads (every one
        without stages). The model is not touched; the programs read these. Returns the names read."""
        return load_weights(self, checkpoint, device)

    # -- saving ----------------------------------------------------------------------------------
    def save(self, path, weights: bool = False, max_shard_size: int | str | None = "5GB"):
        """Write the text program (its values, slots, fixed edits and SAEs) to ``path`` (a ``.qgraph``
        archive, without weights; ``weights=True`` writes them beside it: ``<name>.safetensors``, or
        shards of at most ``max_shard_size`` and ``<name>.safetensors.index.json``).
        ``qgraph.load(path, weights=...)`` runs it with no model class."""
        from .saved import save  # lazy: saved programs, an optional subsystem, load with the first save
        return save(self, path, weights, max_shard_size)

    # -- generating --------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 **kwargs):
        """Generate like HF ``generate`` (greedy, or sampling with ``do_sample=True``, ``temperature``,
        ``top_k``, ``top_p``, ``generator=``/``seed=``; stops on the config's eos ids), decoding from a
        cache, and capture the values at every step: ``out.sequences`` and ``out.steps[k][name]``
        (step 0 the prompt pass, step k the pass over new token k; the last token's pass runs only when
        values are captured), ``out.logits`` and ``out.scores`` one per new token, equal to HF's
        ``output_logits`` and ``output_scores``. ``edits={name: edit}`` apply at
        every step, or at ``steps=[0]`` / ``steps=slice(1, None)`` only. See ``qgraph.generate``."""
        if self._stages is not None:
            raise NotSupported("generate does not run stages yet: generate with an instrument without stages= "
                               "(stages serve prompt passes: calls and capture)")
        return generate(self, input_ids, attention_mask, **kwargs)

    # -- reading the stream -------------------------------------------------------------------
    def top_features(self, input_ids, layer: int | None = None, k: int = 10, attention_mask=None,
                     value: str | None = None):
        """``(activations, features)`` ``[batch, seq, k]``: each token's ``k`` most active features of
        the SAE spliced at block ``layer`` (see ``instrument(..., saes=...)``), largest first, as this
        instrument runs (its fixed edits and other SAEs in place). Where the block has several SAEs,
        ``value`` names the one by the value it reads (``"layers.1.layer_input"``)."""
        from .saes.read import top_features  # lazy: the SAE readers load with their first use
        return top_features(self, input_ids, layer, k, attention_mask, value)

    def project_on_vocab(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of a residual-stream tensor: the model's final norm (its ``1 + weight`` gain), then
        its lm_head, so ``project_on_vocab(layers[-1].layer_output) == logits``."""
        return project_on_vocab(self, hidden)

    def logit_lens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   positions="all", top: int = 5, logits: bool = False):
        """The logit lens, blocks × positions: ``project_on_vocab`` of each block's ``layer_output`` (its
        fixed edits and SAEs in place) at every position (``"all"``, the default, as the lens papers draw
        it) or at ``positions``. A ``LogitLens``: ``top_ids``, ``top_probs`` ``[batch, blocks, positions,
        top]`` (also the dict ``{block: (ids, probabilities)}``); with ``logits=True`` also ``logits`` and
        ``probs`` ``[batch, blocks, positions, vocab]`` (not by default: 12 GB for 512 positions of the
        0.8B). ``.plot()`` draws the grid (``qgraph/lens.py``)."""
        return logit_lens(self, input_ids, attention_mask, positions, top, logits)

    # -- looking: repr(ig) (and ig in a notebook) is a short summary; tree() the module tree annotated with
    # every standard value (qgraph/reprs.py)
    from .reprs import instrumented_repr as __repr__, instrumented_html as _repr_html_

    def tree(self) -> str:
        """The module tree (as ``print(model)``) with each module's standard values and their layouts
        under it; the values this instrument reads are marked ``*``."""
        return annotated_tree(self.model, self.catalogue, highlight=set(self.values))
