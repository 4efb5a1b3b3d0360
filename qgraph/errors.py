"""The errors qgraph raises: one family under ``QgraphError``.

Every error qgraph raises on purpose is a ``QgraphError``, and each keeps the builtin parent it
always had (``EditError`` is a ``ValueError``, ``NotCaptured`` a ``KeyError``...), so both
``except qgraph.QgraphError`` and ``except ValueError`` catch it. The caller's mistakes are kept
apart from qgraph's own: ``InternalError`` is a broken invariant of qgraph's (a graph not as a pass
expects it), a bug to report, never a mistake in what was asked.

This module imports nothing (``import qgraph`` and the ``qgraph`` command's fast paths stay cheap).
"""
from __future__ import annotations

__all__ = ["CaptureCorrupt", "CaptureMismatch", "EditError", "InternalError", "InvalidArgument", "InvalidState",
           "InvalidType", "MissingFile", "NoVisionEncoder", "NotCaptured", "NotSupported", "OutOfRange",
           "QgraphError", "SavedProgramError", "UnavailableValue", "UnknownValue", "UnsupportedModel", "UsageError",
           "WeightsMismatch"]

_REPORT = ("This is a bug in qgraph (or a model version it does not know yet): please report it with the "
           "model's config (model.config.to_dict()).")


class QgraphError(Exception):
    """The base of every error qgraph raises on purpose."""


# -- qgraph's own -----------------------------------------------------------------------------------
class InternalError(QgraphError, RuntimeError):
    """A broken invariant of qgraph's own (a graph not as a pass expects it): a bug, not a mistake in the call."""

    def __str__(self):  # the suffix lives here, not in args, so a pickled error comes back unchanged
        message = super().__str__()
        return f"{message.rstrip('.')}. {_REPORT}" if message else _REPORT


# -- the caller's mistakes, by builtin kind ---------------------------------------------------------
class InvalidArgument(QgraphError, ValueError):
    """An argument of the right type but a wrong value (an empty list, a shape that does not fit)."""


class InvalidType(QgraphError, TypeError):
    """An argument of a type the call does not take."""


class OutOfRange(QgraphError, IndexError):
    """An index (a block, a feature, a row) outside what the model, SAE or capture has."""


class NotSupported(QgraphError, NotImplementedError):
    """Something qgraph does not do (a format's option, a kind of SAE), named in the message."""


class MissingFile(QgraphError, FileNotFoundError):
    """A path given to qgraph where there is no file or dir (or not the one it needs)."""


class InvalidState(QgraphError, RuntimeError):
    """A call that cannot run in the state things are in (weights still on meta, gradients off, a tool failing)."""


# -- the specific ones ------------------------------------------------------------------------------
class EditError(InvalidArgument):
    """An edit that does not fit the value it is applied to; the message names the value and its layout."""


class NotCaptured(QgraphError, KeyError):
    """A name that the call did not capture (or not with gradients); the message says what was."""

    def __str__(self):  # KeyError quotes its message; show it as written
        return self.args[0]


class UnknownValue(QgraphError, KeyError):
    """A name that matches no value of this model; the message lists the closest names."""

    def __str__(self):  # KeyError quotes its message; show it as written
        return self.args[0]


class UnavailableValue(QgraphError, ValueError):
    """A value this model has, but not under this load or on this block; the message says why."""


class NoVisionEncoder(QgraphError, NotImplementedError):
    """``what="vision_block"`` on a model without a vision encoder."""


class CaptureCorrupt(QgraphError, ValueError):
    """A capture dir's shards or manifest are not what the capture wrote (changed, truncated, edited)."""


class CaptureMismatch(QgraphError, ValueError):
    """The out dir holds a capture of another setup (model, values, dataset...)."""


class WeightsMismatch(QgraphError, ValueError):
    """Weights that do not fit what they are loaded for; the message names the tensor."""


class SavedProgramError(QgraphError, ValueError):
    """A saved program that cannot be loaded here, or weights that do not fit it."""


class UnsupportedModel(QgraphError, TypeError):
    """The model is not of a family qgraph knows."""


class UsageError(QgraphError):
    """A mistake in the command line (a bad path, an empty prompt): printed as one line, exit 2."""
