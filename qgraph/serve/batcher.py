"""Requests -> forwards -> replies: one thread runs the model; requests wait in a bounded queue.

The thread takes the oldest waiting request and, if it can share a forward, every other waiting request
of the same program while their rows times the longest length fit the token budget
(``--max-batch-tokens``), as text-generation-inference's router does. A request whose client has gone,
or whose time ran out while it waited, is dropped without running.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future

from ..errors import InvalidArgument
from .limits import Limits
from .request import Request


class QueueFull(InvalidArgument):
    """The server's queue is full (429)."""

    status = 429


class TimedOut(InvalidArgument):
    """A request that waited past the server's time limit (504)."""

    status = 504


class Batcher:
    """``submit(request) -> Future`` of its reply; ``close()`` ends the thread after what it runs."""

    def __init__(self, runner, limits: Limits):
        self.runner, self.limits = runner, limits
        self._waiting: deque[tuple[Request, Future, float]] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self.requests = 0  # requests answered (/v1/health, with the runner's forwards)
        self._thread = threading.Thread(target=self._loop, name="qgraph-serve-batcher", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> Future:
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise QueueFull("the server is shutting down: send the request again later")
            if len(self._waiting) >= self.limits.max_queue:
                raise QueueFull(f"the server's queue is full ({self.limits.max_queue} requests wait): try again "
                                f"shortly")
            self._waiting.append((request, future, time.monotonic() + self.limits.timeout_s))
            self._ready.notify()
        return future

    def stats(self) -> dict:
        return {"waiting": len(self._waiting), "requests": self.requests,
                "forwards": getattr(self.runner, "forwards", 0)}

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, refuse those still waiting, and end the thread once the forward it runs ends."""
        with self._ready:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            self._ready.notify()
        for _, future, _ in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(QueueFull("the server shut down before this request ran: send it again"))
        self._thread.join(timeout)

    def _take(self) -> list[tuple[Request, Future]]:
        """The next forward's requests (waits for one)."""
        with self._ready:
            while not self._waiting and not self._closed:
                self._ready.wait()
            if self._closed:
                return []
            now = time.monotonic()
            first, taken = None, []
            for entry in list(self._waiting):
                request, future, deadline = entry
                if future.cancelled() or now > deadline:  # the client has gone, or its time ran out
                    self._waiting.remove(entry)
                    if not future.cancelled() and future.set_running_or_notify_cancel():
                        future.set_exception(TimedOut(f"the request waited over the server's time limit of "
                                                      f"{self.limits.timeout_s:g} s"))
                    continue
                if first is None:
                    first = request
                elif not (first.batchable and request.key == first.key and self._fits([r for r, _ in taken], request)):
                    continue
                self._waiting.remove(entry)
                taken.append((request, future))
                if not first.batchable:
                    break
        return [(request, future) for request, future in taken if future.set_running_or_notify_cancel()]

    def _fits(self, taken: list[Request], request: Request) -> bool:
        rows = sum(len(r.input_ids) for r in taken) + len(request.input_ids)
        length = max(r.input_ids.shape[1] for r in [*taken, request])
        return rows * length <= self.limits.max_batch_tokens

    def _loop(self) -> None:
        while True:
            taken = self._take()
            if not taken:
                if self._closed:
                    return
                continue
            requests = [request for request, _ in taken]
            try:
                replies = self.runner.run(requests)
            except BaseException as error:  # noqa: BLE001 — every request gets its answer
                replies = [error] * len(requests)
            self.requests += len(requests)
            for (_, future), reply in zip(taken, replies):
                if isinstance(reply, BaseException):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
