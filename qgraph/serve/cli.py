"""``qgraph serve [MODEL]``: host one model for many researchers over HTTP (uvicorn, starlette)."""
from __future__ import annotations

import ipaddress
import socket

from ..errors import UsageError
from .limits import Limits


def add_arguments(parser) -> None:
    defaults = Limits()
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="a local checkpoint dir (default: the embedded tiny Qwen3.5, as qgraph demo)")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (not loopback: needs --api-keys)")
    parser.add_argument("--port", type=int, default=8808, help="the port (0: any free one, printed when ready)")
    parser.add_argument("--api-keys", metavar="FILE", help="a file of keys, one a line: clients send "
                        "'Authorization: Bearer KEY'. Without it the server takes no key and listens on loopback only")
    parser.add_argument("--max-batch-tokens", type=_positive, default=defaults.max_batch_tokens, metavar="N",
                        help="the token budget of one batched forward (rows x padded length); a request alone over "
                             "it gets 413")
    parser.add_argument("--max-request-bytes", type=_positive, default=defaults.max_request_bytes, metavar="N",
                        help="the largest request body (413 beyond it)")
    parser.add_argument("--max-reply-bytes", type=_positive, default=defaults.max_reply_bytes, metavar="N",
                        help="the largest reply, estimated from the values' layouts before the forward (413 beyond "
                             "it): bounds what a request for every value at a long length may make the server hold")
    parser.add_argument("--max-new-tokens", type=_positive, default=defaults.max_new_tokens, metavar="N",
                        help="the most new tokens one request may generate (422 beyond it)")
    parser.add_argument("--max-queue", type=_positive, default=defaults.max_queue, metavar="N",
                        help="requests that may wait (429 beyond it)")
    parser.add_argument("--timeout", type=float, default=defaults.timeout_s, metavar="SECONDS",
                        help="the time limit of one request, from its arrival (504 beyond it)")
    parser.add_argument("--max-edit-work", type=float, default=defaults.max_edit_work, metavar="X",
                        help="a request's function edits may compute at most X times its forward (413 beyond it): "
                             "bounds what a key holder can make the server compute")
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--stages", type=_positive, default=1, metavar="N",
                        help="split the model into N pipeline stages, one per process of "
                             "'torchrun --nproc_per_node N qgraph serve MODEL --stages N' (rank 0 serves HTTP)")


def _positive(text: str) -> int:
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
        except OSError:
            return False


def main(args, load) -> int:
    """``qgraph serve``: the keys (or loopback) checked first, then ``load()`` -> ``(path, model)``, then serve."""
    keys = None
    if args.api_keys is not None:
        # lazy: keeps safetensors, starlette, sympy, torch, tqdm, transformers out until this is used
        from .server import read_keys
        try:
            keys = read_keys(args.api_keys)
        except OSError as error:
            raise UsageError(f"--api-keys {args.api_keys}: {error.strerror or error}") from None
    elif not _loopback(args.host):
        raise UsageError(f"--host {args.host} without --api-keys would serve the model to anyone who can reach it: "
                         f"give --api-keys FILE, or listen on 127.0.0.1")
    limits = Limits(args.max_batch_tokens, args.max_request_bytes, args.max_new_tokens, args.max_queue,
                    max_reply_bytes=args.max_reply_bytes, timeout_s=args.timeout,
                    max_edit_work=args.max_edit_work)
    if args.stages > 1:
        # lazy: keeps safetensors, sympy, torch, tqdm, transformers out until this is used
        from .stages import serve_stages
        return serve_stages(args, keys, load, limits)
    from .run import Runner  # lazy: keeps safetensors, sympy, torch, tqdm, transformers out until this is used
    # lazy: keeps safetensors, starlette, sympy, torch, tqdm, transformers out until this is used
    from .server import serve
    path, model = load()
    return serve(Runner(model, name=str(path), limits=limits), limits, keys, args.host, args.port)
