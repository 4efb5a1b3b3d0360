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


WAIT = 0.05  # seconds the batcher may wait for more requests of a forward (see Batcher._take)
PATIENCE = 0.5  # and at most this part of the last forward's time


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
        self._recent = deque([1], maxlen=4)  # how many requests the last forwards ran
        self._last_forward = 0.0  # seconds the last forward took
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
        """The next forward's requests (waits for one). While fewer wait than the recent forwards ran, it
        waits a little more for them (at most ``PATIENCE`` of the last forward's time, and ``WAIT`` s): clients
        that got their replies together send their next requests a moment apart, and a forward started on
        the first of them alone would leave the rest to wait for the next one."""
        with self._ready:
            while not self._waiting and not self._closed:
                self._ready.wait()
            taken = self._gather([])
            if taken and taken[0][0].batchable:
                deadline = time.monotonic() + min(WAIT, self._last_forward * PATIENCE)
                while len(taken) < max(self._recent) and not self._closed and self._fits(
                        [r for r, _ in taken], taken[0][0]):
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._ready.wait(left):
                        break
                    taken += self._gather(taken)
            if self._closed:
                return []
        return [(request, future) for request, future in taken if future.set_running_or_notify_cancel()]

    def _gather(self, taken: list) -> list[tuple[Request, Future]]:
        """The waiting requests that join ``taken`` (the oldest one, if it is empty), out of the queue."""
        now = time.monotonic()
        joined: list[tuple[Request, Future]] = []
        first = taken[0][0] if taken else None
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
            elif not (first.batchable and request.key == first.key
                      and self._fits([r for r, _ in taken + joined], request)):
                continue
            self._waiting.remove(entry)
            joined.append((request, future))
            if not first.batchable:
                break
        return joined

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
            started = time.monotonic()
            try:
                replies = self.runner.run(requests)
            except BaseException as error:  # noqa: BLE001 — every request gets its answer
                replies = [error] * len(requests)
            self.requests += len(requests)
            self._last_forward = time.monotonic() - started
            self._recent.append(len(requests))
            for (_, future), reply in zip(taken, replies):
                if isinstance(reply, BaseException):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
