"""The bounds of ``qgraph serve`` (its options), importable without torch (the CLI's parser reads them)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What the server takes: ``qgraph serve``'s options."""

    max_batch_tokens: int = 8192  # rows x padded length of one forward (a request alone over it: 413)
    max_request_bytes: int = 64 << 20
    max_new_tokens: int = 256
    max_queue: int = 64
    max_values: int = 512  # names a request may capture
    max_reply_bytes: int = 1 << 30  # what one reply may hold, estimated before the forward (413 beyond it)
    timeout_s: float = 120.0  # from arrival to reply
    max_edit_work: float = 1.0  # a request's function edits compute at most this x its forward (serve/work.py)
