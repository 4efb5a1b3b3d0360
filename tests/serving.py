"""The server the serving tests share: ``qgraph serve`` on the session's tiny checkpoint, in a subprocess
on 127.0.0.1 (port 0: the one it prints), with a keys file; and a server of a runner in this process
(``serve_in_process``), for the tests that hold its forwards."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

KEY = "researcher-key-7f3a"
MEDIA = {"Content-Type": "application/vnd.qgraph.safetensors"}
LIMITS = ["--max-batch-tokens", "256", "--max-request-bytes", "200000", "--max-reply-bytes", "2000000", "--max-new-tokens", "12", "--max-queue", "64"]


def start_server(checkpoint, tmp_path, *extra):
    keys = tmp_path / "keys"
    keys.write_text(f"# the lab's keys\n{KEY}\nother-key\n")
    command = [sys.executable, "-m", "qgraph", "serve", str(checkpoint), "--port", "0", "--api-keys", str(keys),
               *LIMITS, *extra]
    stderr = tmp_path / "stderr"
    with open(stderr, "w") as sink:  # a file, not a pipe: a full pipe would stall the server
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=sink, text=True,
                                   env={**os.environ, "QGRAPH_PROGRESS": "0"})
    line = process.stdout.readline()  # blocks until ready (or the process ends)
    assert line.startswith("qgraph serve: listening on http://127.0.0.1:"), (line, stderr.read_text()[-3000:])
    return process, line.split()[-1]


@contextlib.contextmanager
def serve_in_process(runner, limits):
    """``create_app(runner, limits)`` served by uvicorn in a thread of this process on 127.0.0.1 (port 0, no
    keys): its url. A test can hold the runner's forwards (the server in a subprocess cannot be held)."""
    import uvicorn

    from qgraph.serve.server import create_app
    server = uvicorn.Server(uvicorn.Config(create_app(runner, limits), host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(1000):
            if server.started or not thread.is_alive():
                break
            time.sleep(0.02)
        assert server.started, "the in-process server did not start"
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
