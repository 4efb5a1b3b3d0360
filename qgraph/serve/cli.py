"""``qgraph serve [MODEL]``: host one model for many researchers over HTTP (uvicorn, starlette)."""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import sys

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
    parser.add_argument("--max-new-tokens", type=_positive, default=defaults.max_new_tokens, metavar="N",
                        help="the most new tokens one request may generate (422 beyond it)")
    parser.add_argument("--max-queue", type=_positive, default=defaults.max_queue, metavar="N",
                        help="requests that may wait (429 beyond it)")
    parser.add_argument("--timeout", type=float, default=defaults.timeout_s, metavar="SECONDS",
                        help="the time limit of one request, from its arrival (504 beyond it)")
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--stages", type=_positive, default=1, metavar="N",
                        help="split the model into N pipeline stages, one per process of "
                             "'torchrun --nproc_per_node N qgraph serve MODEL --stages N' (rank 0 serves HTTP)")
    parser.add_argument("--attn-implementation", default="sdpa", choices=["eager", "sdpa"],
                        help="how transformers loads attention")


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


def main(args) -> int:
    from ..cli import checkpoint_path, load_model
    keys = None
    if args.api_keys is not None:
        from .server import read_keys
        try:
            keys = read_keys(args.api_keys)
        except OSError as error:
            raise UsageError(f"--api-keys {args.api_keys}: {error.strerror or error}") from None
    elif not _loopback(args.host):
        raise UsageError(f"--host {args.host} without --api-keys would serve the model to anyone who can reach it: "
                         f"give --api-keys FILE, or listen on 127.0.0.1")
    if args.stages > 1:
        from .stages import serve_stages
        return serve_stages(args, keys)
    path = checkpoint_path(args.model)
    model = load_model(path, args.attn_implementation).to(args.device)
    from .run import Runner
    limits = Limits(args.max_batch_tokens, args.max_request_bytes, args.max_new_tokens, args.max_queue,
                    timeout_s=args.timeout)
    runner = Runner(model, name=str(path))
    return serve(runner, limits, keys, args.host, args.port)


def serve(runner, limits: Limits, keys, host: str, port: int) -> int:
    """Serve until SIGTERM or SIGINT (uvicorn's graceful shutdown: it stops listening, lets the requests in
    flight finish, the batcher refuses those still waiting, and the process exits 0)."""
    import uvicorn

    from .server import create_app
    app = create_app(runner, limits, keys)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=30, lifespan="on")
    server = uvicorn.Server(config)

    async def main_loop():
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            bound = server.servers[0].sockets[0].getsockname()
            where = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
            note = "" if keys else " (no --api-keys: loopback only, no key asked)"
            print(f"qgraph serve: listening on http://{where}:{bound[1]}{note}", flush=True)
        await task

    asyncio.run(main_loop())
    if not server.started:
        print(f"qgraph serve: error: could not listen on {host}:{port}", file=sys.stderr)
        return 2
    return 0
