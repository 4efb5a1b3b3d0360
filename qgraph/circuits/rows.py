"""The rows an attribution computes (one per target: its direct effects from every active feature,
error node and embedding, and its constant), kept in memory or in a file, and the influence of every
active feature on the logits through the rows computed so far.

A long prompt has hundreds of thousands of active features; a graph keeps ``max_feature_nodes`` of
them, chosen as circuit-tracer chooses them: in rounds, the features with the most influence through
the rows so far are attributed next. Their rows span every active feature (the columns a later round
ranks), so they are the largest thing an attribution holds: ``offload="disk"`` keeps them in a file
(a memory map in a temporary folder, removed when the graph is made) instead of in memory.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from ..errors import InvalidArgument

OFFLOADS = (None, "disk")
READ = 1 << 22  # floats read from the store at once (16 MiB): the working memory of spread (one copy of that many)


class Rows:
    """Up to ``capacity`` rows: ``features [n, active]``, ``errors [n, blocks * seq]``, ``embeddings
    [n, seq]``, ``constants [n]``, float32, each written at its row (``put``)."""

    def __init__(self, capacity: int, features: int, errors: int, embeddings: int, offload: str | None = None):
        if offload not in OFFLOADS:
            raise InvalidArgument(f"offload={offload!r}: None (the rows in memory) or 'disk' (in a temporary file)")
        self._folder = tempfile.TemporaryDirectory(prefix="qgraph-rows-") if offload == "disk" else None
        if self._folder is None:
            self.features = torch.zeros(capacity, features)
        else:
            path = Path(self._folder.name) / "features.f32"
            self.features = torch.from_file(str(path), shared=True, size=capacity * features,
                                            dtype=torch.float32).view(capacity, features)
        self.errors, self.embeddings = torch.zeros(capacity, errors), torch.zeros(capacity, embeddings)
        # magnitude: a row's sum of |effects| over every column (features, errors, embeddings), what
        # circuit-tracer's compute_partial_influences normalises each row by
        self.constants, self.magnitude = torch.zeros(capacity), torch.zeros(capacity)
        self.count = 0

    def put(self, part: dict[str, torch.Tensor], at: list[int]) -> None:
        """Write ``part``'s rows at rows ``at`` (one each); ``count`` is then past the last row written."""
        where = torch.tensor(at, dtype=torch.long)
        self.features[where], self.errors[where] = part["features"], part["errors"]
        self.embeddings[where], self.constants[where] = part["embeddings"], part["constants"]
        self.magnitude[where] = sum(part[name].abs().sum(1) for name in ("features", "errors", "embeddings"))
        self.count = max(self.count, max(at, default=-1) + 1)

    def columns(self, rows: list[int], columns: torch.Tensor) -> torch.Tensor:
        """``features[rows][:, columns]``, gathered element by element (no copy of a whole row)."""
        out = torch.empty(len(rows), len(columns))
        order = torch.tensor(rows, dtype=torch.long)
        step = max(1, READ // max(1, len(columns)))
        for start in range(0, len(order), step):
            out[start:start + step] = self.features[order[start:start + step, None], columns]
        return out

    def spread(self, coefficients: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``coefficients @ |features[rows]|``, each row normalised by its magnitude (over every column, the
        errors' and embeddings' too): what those rows pass on to the features. The rows are read
        ``working_rows`` at a time: one copy of at most ``READ`` floats."""
        total = torch.zeros(self.features.shape[1])
        scale = coefficients / self.magnitude[rows].clamp(min=1e-10)
        step = max(1, min(len(rows), working_rows(self.features.shape[1])))
        buffer = torch.empty(step, self.features.shape[1])  # the one copy, reused
        for start in range(0, len(rows), step):
            part = rows[start:start + step]
            read = torch.index_select(self.features, 0, part, out=buffer[:len(part)]).abs_()
            total += scale[start:start + step] @ read
        return total

    def close(self) -> None:
        if self._folder is not None:
            del self.features
            self._folder.cleanup()
            self._folder = None


def working_rows(features: int) -> int:
    """The rows of ``features`` columns that ``spread`` reads at once (``READ`` floats at most, one row at least)."""
    return max(1, READ // max(1, features))


def feature_influence(rows: Rows, n_logits: int, weights: torch.Tensor, done: list[int],
                      layers: torch.Tensor) -> torch.Tensor:
    """Each active feature's influence on the logits (weighted by ``weights``, their probabilities)
    through the rows computed so far: the logits' (rows ``0..n_logits``) and those of the features
    ``done`` (active indices, rows ``n_logits..`` in that order). This is ``graph.influence`` of the
    square matrix these rows make (``weights @ (A + A^2 + ...)``, ``A`` the ``|rows|``, each normalised
    over every column, errors and embeddings included, as there and in circuit-tracer's
    ``compute_partial_influences``) in one pass: a feature's row reaches only features of earlier
    blocks, so taking the done features from the last block down, each one's influence is whole before
    it is passed on."""
    total = rows.spread(weights.float(), torch.arange(n_logits))
    done_t = torch.tensor(done, dtype=torch.long)
    done_layers = layers[done_t] if done else torch.zeros(0, dtype=torch.long)
    for layer in sorted(set(done_layers.tolist()), reverse=True):
        picked = (done_layers == layer).nonzero()[:, 0]
        total += rows.spread(total[done_t[picked]], n_logits + picked)
    return total
