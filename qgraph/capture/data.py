"""Documents in, packed rows out: read a dataset, tokenize it, pack it into ``context``-token rows.

A row is ``context`` tokens of one stream of documents laid end to end, each token with its
``doc_id`` (the document's index in the dataset) and its ``position`` (its index within its
document), so a boundary inside a row is always on record. A document longer than what is left of
a row goes on in the next row, its positions counting on. A text document gets the tokenizer's eos
token appended (Qwen's document separator) where the tokenizer has one; pre-tokenized ``input_ids``
(a list of ints or numpy ints, a 1-D integer tensor or numpy array) are taken as they are. The
last row, if partial, is padded: pad token, ``attention_mask`` 0, ``doc_id`` and ``position`` -1.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import InvalidArgument, InvalidType, MissingFile

# file suffix -> the ``datasets`` builder that reads it (streamed: nothing is converted or cached)
_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text", ".text": "text"}
_TOKENIZE_CHUNK = 64  # documents tokenized per tokenizer call


@dataclass
class Row:
    """One packed row: four 1-D tensors of ``context`` entries."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    doc_id: torch.Tensor
    position: torch.Tensor


def open_dataset(dataset, text_column: str = "text"):
    """``(examples, description)``: an iterable of examples (dicts, or token id lists) and a dict
    saying what was read and how (for the manifest; it is compared on resume)."""
    if isinstance(dataset, (str, os.PathLike)):
        return _open_path(Path(dataset))
    if isinstance(dataset, np.ndarray) and dataset.ndim == 2 and np.issubdtype(dataset.dtype, np.integer):
        dataset = torch.from_numpy(dataset)
    elif isinstance(dataset, np.ndarray):  # an array of documents (an object array of arrays)
        dataset = list(dataset)
    if isinstance(dataset, torch.Tensor):
        if dataset.dim() != 2:
            raise InvalidArgument(f"a tensor dataset is [documents, tokens] token ids, got shape "
                                  f"{tuple(dataset.shape)}")
        return dataset.tolist(), {"type": "tensor", "documents": dataset.shape[0], "tokens": dataset.numel()}
    if isinstance(dataset, dict):
        if "input_ids" not in dataset:
            raise InvalidArgument(f"a dict dataset needs 'input_ids' (one token id list per document), it has "
                                  f"{sorted(dataset)}")
        return open_dataset(dataset["input_ids"], text_column)
    kind = f"{type(dataset).__module__}.{type(dataset).__name__}"
    if kind.startswith("datasets.") and "Dict" in type(dataset).__name__:
        raise InvalidArgument(f"the dataset has splits {list(dataset)}: pass one of them (dataset['train'])")
    if kind.startswith("datasets."):
        description: dict[str, object] = {"type": type(dataset).__name__,
                                          "columns": sorted(dataset.column_names or [])}
        if hasattr(dataset, "__len__"):
            description["documents"] = len(dataset)
        return dataset, description
    if isinstance(dataset, (list, tuple)):
        return dataset, {"type": "list", "documents": len(dataset)}
    raise InvalidType(f"dataset: {type(dataset).__name__} is not a datasets.Dataset / IterableDataset, a path, "
                      f"a [documents, tokens] tensor or array, or a list of texts or token id lists")


def _open_path(path: Path):
    import datasets
    if not path.exists():
        raise MissingFile(f"dataset {path}: no such file or directory")
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise InvalidArgument(f"dataset {path} is a DatasetDict with splits {splits}: give one split's dir "
                                  f"({path / splits[0]})" if splits else f"dataset {path} is an empty DatasetDict")
        if not (path / "state.json").is_file():
            raise InvalidArgument(f"dataset {path}: not a dir that datasets' save_to_disk wrote (it has no "
                                  f"state.json); give that dir, or a parquet, jsonl or text file")
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        return datasets.load_from_disk(str(path)), {"path": str(path.resolve()), "read_as": "datasets.load_from_disk",
                                                     "bytes": size}
    builder = _BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise InvalidArgument(f"dataset {path}: unknown file type '{path.suffix}'; give a .parquet, .jsonl, .json or "
                              f".txt file, or a dir that datasets' save_to_disk wrote")
    examples = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
    how = (f"datasets.load_dataset('{builder}', streaming=True)"
           + (", one document per line" if builder == "text" else ""))
    return examples, {"path": str(path.resolve()), "read_as": how, "bytes": path.stat().st_size}


def documents(examples, tokenizer=None, text_column: str = "text", chat_template: bool = False):
    """Each example's token ids (a list of ints), in order; texts are tokenized in chunks."""
    eos = getattr(tokenizer, "eos_token_id", None)
    iterator = iter(examples)
    while chunk := list(itertools.islice(iterator, _TOKENIZE_CHUNK)):
        texts, tokens = [], []
        for example in chunk:
            ids = _ids_of(example)
            tokens.append(ids)
            if ids is None:
                texts.append(_text_of(example, text_column, tokenizer, chat_template))
        if texts:
            if tokenizer is None:
                raise InvalidArgument("the dataset holds text: pass the tokenizer (or a dataset of input_ids)")
            encoded = iter(tokenizer(texts, add_special_tokens=not chat_template)["input_ids"])
            tokens = [next(encoded) + ([eos] if eos is not None else []) if ids is None else ids for ids in tokens]
        yield from tokens


def _ids_of(example):
    """An example's token ids (a list of ints) if it is pre-tokenized, else None."""
    if isinstance(example, dict):
        example = example.get("input_ids")
    if isinstance(example, (torch.Tensor, np.ndarray)):
        integer = (np.issubdtype(example.dtype, np.integer) if isinstance(example, np.ndarray)
                   else not (example.dtype.is_floating_point or example.dtype.is_complex))
        if example.ndim != 1 or not integer:
            raise InvalidArgument(f"a document's token ids are a 1-D sequence of ints, got a "
                                  f"{type(example).__name__} of shape {tuple(example.shape)} and dtype {example.dtype}")
        return example.tolist()
    if isinstance(example, (list, tuple)) and all(isinstance(token, (int, np.integer)) for token in example):
        return [int(token) for token in example]
    return None


def _text_of(example, text_column: str, tokenizer, chat_template: bool) -> str:
    text = example
    if isinstance(example, dict):
        if text_column not in example:
            raise InvalidArgument(f"the dataset has no column '{text_column}' (it has {sorted(example)}); pass "
                                  f"text_column= (--text-column) naming the text, or give input_ids")
        text = example[text_column]
    if chat_template:
        messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
        return tokenizer.apply_chat_template(messages, tokenize=False)
    if not isinstance(text, str):
        raise InvalidArgument(f"column '{text_column}' holds {type(text).__name__}, neither text nor token ids (ints) "
                              f"(chat messages need chat_template=True)")
    return text


def pack(token_lists, context: int, max_tokens: int | None = None, pad_id: int = 0):
    """Rows of ``context`` tokens from the documents' token lists (see the module doc); at most
    ``max_tokens`` real tokens in all (the document that crosses the limit is cut there)."""
    ids: list[int] = []
    docs: list[int] = []
    positions: list[int] = []
    taken = 0
    for doc_id, tokens in enumerate(token_lists):
        if max_tokens is not None:
            tokens = tokens[:max_tokens - taken]
        taken += len(tokens)
        ids.extend(tokens)
        docs.extend([doc_id] * len(tokens))
        positions.extend(range(len(tokens)))
        while len(ids) >= context:
            yield _row(ids[:context], docs[:context], positions[:context], context, pad_id)
            del ids[:context], docs[:context], positions[:context]
        if max_tokens is not None and taken >= max_tokens:
            break
    if ids:
        yield _row(ids, docs, positions, context, pad_id)


def _row(ids, docs, positions, context: int, pad_id: int) -> Row:
    pad = context - len(ids)
    mask = torch.ones(context, dtype=torch.int64)
    if pad:
        mask[len(ids):] = 0
    return Row(torch.tensor(ids + [pad_id] * pad, dtype=torch.int64), mask,
               torch.tensor(docs + [-1] * pad, dtype=torch.int64),
               torch.tensor(positions + [-1] * pad, dtype=torch.int64))
