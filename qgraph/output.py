"""What an instrumented call returns: ``Output``, the logits and the captured values by name."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from . import reprs
from .attribution import LogitAttribution, ResidualStack, logit_attribution, residual_stack
from .errors import InvalidArgument, InvalidState, NotCaptured
from .kernels import views
from .values.names import canonical
from .plots import plot
from .values.names import matching


@dataclass
class Output:
    """What an instrumented call returns: the model's logits and the captured values by name.

    ``out[name]`` takes the spellings ``values=`` takes (``layers[-1].layer_output``).
    """

    logits: torch.Tensor | None
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    blocks: int = 0  # the model's block count, to read negative block indices
    # for each value asked with {"grad": True}: the tensor its readers read (or, from stages in one process
    # with micro-batches, the tuple of each micro-batch's, joined along the batch), and the view it is served through
    watched: dict[str, tuple[torch.Tensor | tuple, tuple]] = field(default_factory=dict, repr=False)
    # name -> its standard names (values.names.aliases): out["blocks.3.hook_resid_post"] reads layers.3.layer_output
    aliases: Callable[[str], list[str]] | None = field(default=None, repr=False)
    # what made it (the instrumented model or loaded program) and the call's tokens: out.plot reads the values'
    # layouts and the tokenizer's folder from the one and labels its axes with the other
    source: object = field(default=None, repr=False, compare=False)
    input_ids: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # a call with loss=fn: the loss's value (its backward has run; None on a rank without the last stage)
    loss: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # the call's attention mask and its edits= as given: what a decomposition reruns the call with when this
    # output lacks a value it reads (out.logit_attribution, out.residual_stack)
    attention_mask: torch.Tensor | None = field(default=None, repr=False, compare=False)
    edits: Mapping | None = field(default=None, repr=False, compare=False)

    def plot(self, name: str, tokens=None, tokenizer=None, **options):
        """A ``qgraph.Figure`` of a captured value, drawn as its layout says (``qgraph/plots/``): an
        attention pattern one panel per head, DeltaNet decays and betas tokens × heads, states their
        norms and one head's matrix, the residual stream its norm per token (blocks × tokens for a
        glob), SAE features the top ones per token; each with its colour scale, and an HTML form that
        shows a cell's value on hover. ``tokens`` (strings) label the token axes (default: the call's
        tokens, decoded by ``tokenizer`` or the model's own where its folder has one); ``batch=0`` picks
        the row."""
        return plot(self, name, tokens, tokenizer, **options)

    def logit_attribution(self, tokens, against=None, *, positions=None, per: str = "head") -> LogitAttribution:
        """Each component's direct contribution to the logit of ``tokens`` (or to ``tokens``' minus
        ``against``'s), through the final norm with its scale frozen at this call's own (TransformerLens's
        ``logit_attrs`` after ``apply_ln_to_stack``): a ``LogitAttribution`` whose ``attributions
        [components, batch, positions]`` plus its ``bias`` terms sum to ``total``, the call's logit (difference).

        ``tokens`` and ``against`` are ids: an int, one per batch row, or ``[batch, positions]`` (the next
        tokens: ``ids[:, 1:]`` at ``positions=range(seq - 1)``). ``positions`` (default every one) picks
        token positions. ``per="head"`` (default) splits each mixer into its heads (attention's gated heads
        through ``o_proj``; DeltaNet's value heads, after the gated norm, through ``out_proj``), each
        mixture-of-experts MLP into its routed experts and its gated shared expert, and each spliced SAE or
        transcoder into its features (its decoder bias, skip path and error are bias terms);
        ``per="component"`` keeps each block's mixer and MLP whole, ``per="block"`` each block. Labels:
        ``embed``, ``layers.3.self_attn.head.2``, ``layers.0.linear_attn.head.5``, ``layers.1.mlp.expert.7``,
        ``layers.1.mlp.shared_expert``, ``layers.2.mlp``, ``layers.1.layer_output.sae.feature.40``.

        The values it reads are this output's where it captured them all (the call's edits in force);
        otherwise the call is run again, with its tokens, mask and edits, through ``source.variant`` (a
        call with images cannot be: capture the values named in the error). A remote instrument holds no
        weights: decompose where they are (``qgraph/attribution/``)."""
        return logit_attribution(self, tokens, against, positions=positions, per=per)

    def residual_stack(self, name: str, *, per: str = "component", positions=None) -> ResidualStack:
        """The components whose sum is the residual value ``name`` (``layers.3.layer_output``,
        ``layer_mid``, ``layer_input``, or their TransformerLens names, ``blocks.3.hook_resid_post``), as
        TransformerLens's ``decompose_resid`` / ``stack_head_results``: a ``ResidualStack`` whose ``stack
        [components, batch, positions, hidden]`` plus its ``bias`` terms sum to ``value``. ``per`` as
        ``logit_attribution``'s, ``"component"`` by default; at ``"head"`` a dictionary's features stay
        one component (``layers.1.sae.features``: per feature they would be d_sae vectors a token).
        What the final norm reads is ``layers[-1].layer_output``. Values as ``logit_attribution`` gets them."""
        return residual_stack(self, name, per=per, positions=positions)

    def __getitem__(self, name: str) -> torch.Tensor:
        key = canonical(name, self.blocks, self.aliases)
        if key not in self.values:
            raise NotCaptured(f"'{name}' was not captured; captured: {', '.join(self.values) or 'nothing'}")
        return self.values[key]

    def grad(self, name: str) -> torch.Tensor:
        """The gradient of the loss you called ``backward()`` on with respect to a value asked with
        ``values={name: {"grad": True}}``, in the value's layout (as ``x.grad`` of the tensor the
        rest of the model read: an edited value's gradient is the edited tensor's)."""
        key = self._watched(name)
        tensor, view = self.watched[key]
        pieces = pieces_of(tensor)
        if not any(piece.requires_grad for piece in pieces):
            raise InvalidState(f"'{key}' has no gradient: the call ran with gradients off (torch.no_grad or "
                               f"inference_mode); call the instrumented model outside it")
        grads = [piece.grad for piece in pieces]
        if all(grad is None for grad in grads):
            raise InvalidState(f"no gradient has reached '{key}' yet: call backward() on a loss computed from this "
                               f"call's outputs first (a loss that does not depend on '{key}' gives it none)")
        # a micro-batch the loss does not read got no gradient: zeros, as one tensor's rows would get
        return views.apply(_cat([torch.zeros_like(p) if g is None else g for p, g in zip(pieces, grads)]), view)

    def gradients(self, loss: torch.Tensor, names=None) -> dict[str, torch.Tensor]:
        """``{name: d loss / d value}`` for the ``grad`` values (or ``names`` of them), computed with
        ``torch.autograd.grad``: no ``.grad`` of the model's parameters is touched. A value the loss does
        not depend on gets zeros."""
        keys = [self._watched(name) for name in (names if names is not None else self.watched)]
        pieces = [pieces_of(self.watched[key][0]) for key in keys]
        grads = iter(torch.autograd.grad(loss, [p for parts in pieces for p in parts], allow_unused=True,
                                         materialize_grads=True))
        return {key: views.apply(_cat([next(grads) for _ in parts]), self.watched[key][1])
                for key, parts in zip(keys, pieces)}

    def _watched(self, name: str) -> str:
        key = canonical(name, self.blocks, self.aliases)
        if key not in self.watched:
            asked = ", ".join(self.watched) or "none"
            raise NotCaptured(f"'{name}' was not asked with gradients: instrument with "
                              f"values={{'{name}': {{'grad': True}}}} (values with gradients: {asked})")
        return key

    def __contains__(self, name: str) -> bool:
        return canonical(name, self.blocks, self.aliases) in self.values

    # -- looking: keys, items, stack, and short reprs (qgraph/reprs.py) --------------------------------------
    def keys(self):
        """The captured values' names, in capture order (``out.logits`` is not one of them)."""
        return self.values.keys()

    def items(self):
        """``(name, tensor)`` of every captured value, in capture order (``out.logits`` apart)."""
        return self.values.items()

    def select(self, pattern: str) -> list[str]:
        """The captured names ``pattern`` (a name, an alias or a glob, ``"layers.*.layer_output"``) selects,
        in block order (block 10 after block 2); ``NotCaptured`` when it selects none."""
        patterns = [pattern]
        if self.aliases is not None and isinstance(pattern, str):
            try:
                patterns = self.aliases(pattern) or patterns
            except KeyError:  # a name the aliases refuse: matched as written
                pass
        names = list(dict.fromkeys(name for each in patterns for name in matching(each, self.values, self.blocks)))
        if not names:
            raise NotCaptured(f"'{pattern}' matches no captured value; captured: {reprs.names_text(self.values)}")
        return sorted(names, key=lambda name: [int(part) for part in name.split(".") if part.isdigit()])

    def stack(self, pattern: str) -> torch.Tensor:
        """The values ``pattern`` (a glob, ``"layers.*.layer_output"``) selects among those captured, stacked
        on a new leading axis in block order (block 10 after block 2)."""
        names = self.select(pattern)
        shapes = {(tuple(self.values[name].shape), self.values[name].dtype) for name in names}
        if len(shapes) > 1:
            found = "; ".join(f"{name} {reprs.shape(self.values[name])} {reprs.dtype(self.values[name])}"
                              for name in names)
            raise InvalidArgument(f"'{pattern}' selects values of different shapes or dtypes, which do not stack: "
                                  f"{found}")
        return torch.stack([self.values[name] for name in names])

    __repr__, _repr_html_ = reprs.shown(reprs.output)


def pieces_of(tensor) -> tuple:
    """A watched value's tensors: itself alone, or its micro-batches' (a tuple, joined along the batch)."""
    return tensor if isinstance(tensor, tuple) else (tensor,)


def retain(tensor) -> None:
    """Keep the gradient a backward gives each of a watched value's tensors (``.grad``; a no-op on a leaf)."""
    for piece in pieces_of(tensor):
        if piece.requires_grad:
            piece.retain_grad()


def _cat(pieces: list) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
