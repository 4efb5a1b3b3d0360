"""The ASGI app of ``qgraph serve`` (starlette): its routes, its keys and its limits.

- ``GET /v1/health``: 200, no key.
- ``GET /v1/info``: the model and its value catalogue.
- ``POST /v1/run``: one call (``serve/request.py``), its body and reply in ``serve/wire.py``'s format.

Every refusal is JSON ``{"error": ...}``: 401 (no key, or not one of the server's), 400 (a body that does
not parse), 413 (over ``--max-request-bytes``, refused before it is read whole, or over the token
budget), 422 (a request that cannot run), 429 (the queue is full), 504 (over the time limit). Keys are
compared in constant time and never logged. A client that goes away while its request waits costs
nothing more: the request is dropped before it runs.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import sys
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import InternalError, QgraphError
from .batcher import Batcher
from .limits import Limits
from .request import Unprocessable, request_of
from .wire import Bounds, WireError, pack, parse

log = logging.getLogger("qgraph.serve")
MEDIA_TYPE = "application/vnd.qgraph.safetensors"


def read_keys(path) -> list[bytes]:
    """The keys of ``--api-keys``: one a line; blank lines and ``#`` comments skipped."""
    lines = open(path, encoding="utf-8").read().splitlines()
    keys = [line.strip().encode() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise QgraphError(f"--api-keys {path} holds no key: write one key a line")
    return keys


def create_app(runner, limits: Limits = Limits(), keys: list[bytes] | None = None) -> Starlette:
    """The app serving ``runner`` (``serve.run.Runner``) within ``limits``; ``keys=None`` takes no key."""
    state = {}
    info = runner.info()

    @asynccontextmanager
    async def lifespan(app):
        state["batcher"] = Batcher(runner, limits)
        try:
            yield
        finally:
            await run_in_threadpool(state["batcher"].close, 60)

    def authorized(request: HTTPRequest) -> JSONResponse | None:
        if keys is None:
            return None
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not key:
            return _error(401, "this server takes a key: send the header Authorization: Bearer KEY")
        found = False
        for known in keys:  # every key compared, each in constant time
            found |= hmac.compare_digest(known, key.strip().encode())
        return None if found else _error(401, "the key is not one of this server's keys")

    async def health(request: HTTPRequest) -> Response:
        batcher = state.get("batcher")
        return JSONResponse({"status": "ok", **(batcher.stats() if batcher else {})})

    async def describe(request: HTTPRequest) -> Response:
        return authorized(request) or JSONResponse(info)

    def checked(call: dict, tensors: dict):
        """The call's ``Request``, its fields checked (serve/request.py) and then against the model
        (``runner.check``: a generate's settings, the work of its function edits), before it is queued;
        off the event loop."""
        parsed = request_of(call, tensors, limits)
        runner.check(parsed)
        return parsed

    async def run(request: HTTPRequest) -> Response:
        refused = authorized(request)
        if refused:
            return refused
        body = await _body(request, limits.max_request_bytes)
        if isinstance(body, Response):
            return body
        try:
            call, tensors = await run_in_threadpool(parse, body, Bounds())
            parsed = await run_in_threadpool(checked, call, tensors)
            parsed.body = body
            future = state["batcher"].submit(parsed)
        except QgraphError as error:
            return _error(getattr(error, "status", 422), str(error))
        waiting, gone = asyncio.wrap_future(future), asyncio.ensure_future(_disconnected(request))
        # woken by the reply, the client's going or the time limit: no polling (a wake-up during a forward
        # would take a core from the model's threads)
        await asyncio.wait([waiting, gone], timeout=limits.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not waiting.done():
            future.cancel()  # dropped unless it runs already
            waiting.cancel()
            return _error(504, f"the request ran over the server's time limit of {limits.timeout_s:g} s")
        try:
            reply = waiting.result()
        except QgraphError as error:  # a qgraph error of its own (a broken invariant of qgraph's: 500)
            return _error(getattr(error, "status", 500 if isinstance(error, InternalError) else 422), str(error))
        except asyncio.CancelledError:
            return _error(503, "the server dropped the request")
        except Exception as error:  # noqa: BLE001 — the request's own failure (its function edit, its inputs)
            if parsed.edits:
                return _error(422, f"the request failed as it ran: {type(error).__name__}: {str(error)[:500]}")
            log.exception("qgraph serve: a request failed")
            return _error(500, f"the server failed on this request: {type(error).__name__}: {str(error)[:500]}")
        return Response(await run_in_threadpool(pack, *reply), media_type=MEDIA_TYPE)

    routes = [Route("/v1/health", health), Route("/v1/info", describe), Route("/v1/run", run, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        404: lambda request, exc: _error(404, f"no route {request.url.path}: the routes are /v1/health, /v1/info, "
                                              f"/v1/run"),
        405: lambda request, exc: _error(405, f"{request.method} {request.url.path} is not served: GET /v1/health, "
                                              f"GET /v1/info, POST /v1/run")})
    app.state.serving = state
    return app


async def _body(request: HTTPRequest, limit: int) -> bytes | Response:
    """The body, or a 413 before more than ``limit`` bytes are read (a declared length over it, or a
    chunked body that grows past it)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            return _error(400, f"Content-Length is {declared[:40]!r}, not a number of bytes")
        if int(declared) > limit:
            return _error(413, f"the body is {int(declared):,} bytes, more than this server's --max-request-bytes "
                               f"{limit:,}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return _error(413, f"the body is over this server's --max-request-bytes {limit:,} (refused as it came)")
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: HTTPRequest) -> None:
    """Returns once the client has gone (the server's next message after the body is ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def serve(runner, limits: Limits, keys, host: str, port: int) -> int:
    """Serve until SIGTERM or SIGINT (uvicorn's graceful shutdown: it stops listening, lets the requests in
    flight finish, the batcher refuses those still waiting, and the process exits 0)."""
    import uvicorn

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


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


__all__ = ["create_app", "read_keys", "serve", "MEDIA_TYPE", "Unprocessable", "WireError"]
