"""The shard writer: a thread that joins a shard's batches, writes, syncs, hashes and records it
while the next forwards run. Its queue is bounded, so at most ``depth`` shards wait in memory (the
main loop blocks on a full queue instead of running ahead of the disk).

A shard is written to ``shards/.NAME.tmp`` (with its place in the capture in its metadata, see
``integrity``), hashed, synced and renamed to ``shards/NAME``; only then is it added, with its size
and sha256, to ``shards/r{rank}-done.json``. A run killed at any point leaves either a whole shard
or none, and a whole shard it did not record is simply written again on resume.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .integrity import file_sha256, shard_metadata
from .manifest import done_path, write_json

# Test hook: stop the process (as a kill would) once this many shards are written in this run.
STOP_AFTER_ENV = "QGRAPH_CAPTURE_STOP_AFTER"


@dataclass
class ShardJob:
    """A shard ready to write: its record (file, rank, index, rows...) and each tensor's batches."""

    record: dict
    parts: dict[str, list[torch.Tensor]]


class ShardWriter:
    """``put(job)`` hands a shard to the thread; ``close()`` waits for the queue to drain and raises
    the thread's error if it had one. ``records`` are this rank's finished shards, in index order."""

    def __init__(self, out: Path, rank: int, records: list[dict], depth: int = 2):
        self.out, self.rank, self.records = out, rank, list(records)
        self.bytes_written, self.started = 0, time.perf_counter()
        self.error: BaseException | None = None
        self._stop_after = int(os.environ.get(STOP_AFTER_ENV, "0") or 0)
        self._written = 0
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name=f"qgraph-capture-writer-r{rank}", daemon=True)
        self._thread.start()

    def put(self, job: ShardJob) -> None:
        self._raise()
        self._queue.put(job)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._raise()

    def mb_per_s(self) -> float:
        return self.bytes_written / 1e6 / max(time.perf_counter() - self.started, 1e-9)

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the shard writer failed: {self.error}") from self.error

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if self.error is None:  # after a failure, only drain the queue so put() never blocks
                try:
                    self._write(job)
                except BaseException as error:  # noqa: BLE001 (handed to the main thread)
                    self.error = error

    def _write(self, job: ShardJob) -> None:
        from safetensors.torch import save_file
        tensors = {name: torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
                   for name, parts in job.parts.items()}
        path = self.out / job.record["file"]
        temporary = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(temporary), metadata=shard_metadata(job.record))
        del tensors, job.parts
        sha256 = file_sha256(temporary, sync=True)
        os.replace(temporary, path)
        size = path.stat().st_size
        self.records.append({**job.record, "bytes": size, "sha256": sha256, "done": True})
        self.records.sort(key=lambda r: r["index"])
        write_json(done_path(self.out, self.rank), self.records)
        self.bytes_written += size
        self._written += 1
        if self._stop_after and self._written >= self._stop_after:
            os._exit(17)  # the test hook: die here, as a killed run would
