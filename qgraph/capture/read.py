"""Reading a capture back: ``load_capture("acts/")`` is a ``torch.utils.data.Dataset`` over rows.

Rows are in global row order (a torchrun capture's ranks interleave back into the order of a
one-process run). Shards are opened with ``safetensors.safe_open`` and read a row at a time, so
nothing is loaded whole. Nothing damaged is read as data (see ``integrity``): opening a capture
checks the manifest's layout, each shard's size and each shard's header (its own record of its
place and rows) against its manifest entry; the first read from a shard checks its sha256.

    cap = load_capture("acts/")
    len(cap)                               # rows
    cap[0]["layers.3.layer_output"]        # one row's tensors, by name, with input_ids, doc_id, ...
    cap.values("layers.3.layer_output")    # one tensor across all rows
    cap.to_datasets("acts-hf/")            # a datasets.Dataset SAELens's ActivationsStore reads
"""
from __future__ import annotations

import bisect
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import InvalidArgument, MissingFile, OutOfRange, UnknownValue
from ..values.aliases import tl_names
from .integrity import CaptureCorrupt, check_bytes, check_header, check_layout
from .manifest import FORMAT, META
from ..reprs import capture

if TYPE_CHECKING:  # a type only: safetensors is imported when a shard is first read
    from safetensors import safe_open


class Capture(torch.utils.data.Dataset):
    """The rows of a finished capture (see the module doc)."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        path = self.out / "manifest.json"
        if not path.is_file():
            raise MissingFile(f"{self.out}: no manifest.json, not a capture dir")
        try:
            self.manifest = json.loads(path.read_text())
            kind = self.manifest.get("format")
        except (ValueError, AttributeError) as error:
            raise CaptureCorrupt(f"{path} is not a readable capture manifest ({error}): capture into a new dir, "
                                 f"or delete {self.out} and capture again") from None
        if kind != FORMAT:
            raise CaptureCorrupt(f"{path} is a {kind!r} manifest, this qgraph reads {FORMAT}: capture again with "
                                 f"this qgraph")
        if not self.manifest.get("complete"):
            raise InvalidArgument(f"{self.out}: the capture is not finished (rerun the same capture to complete it)")
        check_layout(self.out, self.manifest)
        self.names = [value["name"] for value in self.manifest["identity"]["values"]]
        for shard in self.manifest["shards"]:
            check_header(self.out, shard, [*self.names, *META])
        # global row -> (shard, row within it), in global row order
        located = sorted((shard["row_start"] + k * shard["row_step"], position, k)
                         for position, shard in enumerate(self.manifest["shards"]) for k in range(shard["rows"]))
        self._rows = [row for row, _, _ in located]
        self._where = [(position, k) for _, position, k in located]
        self._files: dict[int, safe_open] = {}  # shard position -> its open file

    def __len__(self) -> int:
        return len(self._where)

    def __repr__(self) -> str:  # short: where, rows, values, shards (qgraph/reprs.py)
        return capture(self).text()

    def _repr_html_(self) -> str:
        return capture(self).html()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise OutOfRange(f"row {index} of a capture of {len(self)} rows")
        position, k = self._where[index]
        file = self._open(position)
        return {name: file.get_slice(name)[k] for name in file.keys()}

    def row_index(self, index: int) -> int:
        """The global row index of the ``index``-th row (equal to ``index`` when no row is missing)."""
        return self._rows[index]

    def find(self, row: int) -> int:
        """The position of global row ``row``."""
        position = bisect.bisect_left(self._rows, row)
        if position == len(self._rows) or self._rows[position] != row:
            raise KeyError(f"row {row} is not in this capture")
        return position

    def values(self, name: str) -> torch.Tensor:
        """``name`` (a value or input_ids, attention_mask, doc_id, position) over every row, in row order."""
        if name not in self.names and name not in META:
            raise UnknownValue(f"'{name}' is not in this capture; it holds {self.names} and {list(META)}")
        return torch.stack([self[index][name] for index in range(len(self))]) if len(self) else torch.empty(0)

    def to_datasets(self, path: str | Path | None = None, names=None):
        """The capture as a Hugging Face ``datasets.Dataset`` of rows, one ``Array2D [context, width]``
        column per value, named as SAELens names its hook (``saelens_name``), and ``token_ids``
        (int32): the columns SAELens's ``ActivationsStore`` reads from ``cached_activations_path``.
        Written with ``save_to_disk(path)`` when ``path`` is given. bfloat16 values are stored as
        float32 (Arrow has no bfloat16).

        Every exported row is ``context`` real tokens: SAELens reads whole rows and has no mask, so
        the capture's last row, when padded, is left out, with a warning saying how many real tokens
        that drops."""
        from datasets import Array2D, Dataset, Features, Sequence, Value

        names = list(names or self.names)
        if not len(self):
            raise InvalidArgument(f"{self.out}: the capture holds no rows (its dataset gave no tokens): nothing to "
                                  f"export; capture a dataset with tokens")
        first = self[0]
        columns, features = {}, {}
        for name in names:
            if name not in first:
                raise UnknownValue(f"'{name}' is not in this capture; it holds {self.names}")
            if first[name].dim() != 2:
                raise InvalidArgument(f"'{name}' is {tuple(first[name].shape)} per row; a datasets column for SAELens "
                                      f"holds [context, width] per row: read it with cap.values('{name}') instead")
            dtype = torch.float32 if first[name].dtype == torch.bfloat16 else first[name].dtype
            columns[name] = saelens_name(name)
            features[columns[name]] = Array2D(shape=tuple(first[name].shape), dtype=str(dtype).removeprefix("torch."))
        context = first["input_ids"].shape[0]
        features["token_ids"] = Sequence(Value("int32"), length=context)

        rows, padded = len(self), int((self[len(self) - 1]["attention_mask"] == 0).sum())
        if padded:  # only the last row is ever padded (see data.pack)
            rows -= 1
            if not rows:
                raise InvalidArgument(f"{self.out}: the capture's only row is padded ({context - padded} real tokens "
                                      f"of {context}): nothing to export; capture at least context={context} tokens")
            warnings.warn(f"qgraph: to_datasets leaves out the capture's last row, padded at {padded} of its "
                          f"{context} positions (SAELens reads whole rows); its {context - padded} real tokens "
                          f"are not in the dataset, which has {rows} rows", stacklevel=2)
        shards = " ".join(shard["sha256"] for shard in self.manifest["shards"])  # a str: datasets splits lists
        dataset = Dataset.from_generator(_saelens_rows, features=Features(features),
                                         gen_kwargs={"out": str(self.out), "columns": columns, "rows": rows,
                                                     "shards": shards},
                                         cache_dir=str(self.out / ".datasets-cache"))
        if path is not None:
            dataset.save_to_disk(str(path))
        return dataset

    def _open(self, position: int):
        from safetensors import safe_open
        if position not in self._files:
            shard = self.manifest["shards"][position]
            check_bytes(self.out, shard)  # its sha256, before anything in it is read
            self._files[position] = safe_open(str(self.out / shard["file"]), "pt")
        return self._files[position]


def saelens_name(name: str) -> str:
    """The SAELens hook name of a value (``layers.3.layer_output`` -> ``blocks.3.hook_resid_post``), its
    first TransformerLens name in the family's table (``values.aliases``); a value with none keeps its name."""
    return next(iter(tl_names(name)), name)


def _saelens_rows(out: str, columns: dict[str, str], rows: int, shards: str):
    """The first ``rows`` rows of ``to_datasets`` (a function of plain arguments: ``datasets`` hashes
    it, and ``shards``, the shards' sha256, keeps a cache of another capture in ``out`` from being used)."""
    capture = Capture(out)
    for index in range(rows):
        row = capture[index]
        yield {**{column: (row[name].float() if row[name].dtype == torch.bfloat16 else row[name]).numpy()
                  for name, column in columns.items()}, "token_ids": row["input_ids"].int().numpy()}


def load_capture(out: str | Path) -> Capture:
    """The rows of the capture in ``out`` as a ``torch.utils.data.Dataset`` (see ``Capture``)."""
    return Capture(out)
