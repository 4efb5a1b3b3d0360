"""``torchrun --nproc_per_node 2 -m qgraph serve MODEL --stages 2``: rank 0 serves HTTP, both ranks run their
stage (gloo); replies equal local ``qgraph.instrument``, requests that arrive together share a forward, and
SIGTERM to torchrun ends every process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

import qgraph
from tests.serving import KEY

pytestmark = pytest.mark.slow  # two torchrun ranks serving (python -m pytest -m slow)


def _processes_naming(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def staged_server(checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-stages")
    keys = folder / "stage-keys"
    keys.write_text(KEY + "\n")
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--nproc_per_node", "2", "-m", "qgraph", "serve", str(checkpoint), "--stages", "2",
               "--port", "0", "--api-keys", str(keys)]
    with open(folder / "stderr", "w") as sink:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=sink, text=True,
                                   env={**os.environ, "QGRAPH_PROGRESS": "0", "OMP_NUM_THREADS": "1"})
    line = process.stdout.readline()
    assert line.startswith("qgraph serve: listening on http://127.0.0.1:"), (line, (folder / "stderr").read_text())
    yield process, line.split()[4], str(keys)
    if process.poll() is None:
        process.kill()
        process.wait(30)


def test_two_stages_serve_values_equal_to_local(staged_server, sdpa_model):
    process, url, marker = staged_server
    assert len(_processes_naming(marker)) >= 2  # torchrun and its two ranks
    ig = qgraph.remote(url, api_key=KEY).instrument(values=["layers.*.layer_output"], edits=["layers.2.layer_output"])
    local = qgraph.instrument(sdpa_model, values=["layers.*.layer_output"])

    def one(seed):
        ids = torch.randint(0, 256, (1, 4 + seed % 3), generator=torch.Generator().manual_seed(seed))
        edits = {"layers.2.layer_output": qgraph.Zero(positions=[-1])}  # an edit on the second stage
        return ig(ids, edits=edits), local(ids, edits=edits)

    with ThreadPoolExecutor(4) as pool:
        pairs = list(pool.map(one, range(8)))
    for out, ref in pairs:
        torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-5)
        for name in ref.values:  # each stage's values, gathered to rank 0
            torch.testing.assert_close(out[name], ref[name], rtol=0, atol=1e-5)
    health = httpx.get(f"{url}/v1/health").json()
    assert health["requests"] >= 8 and health["forwards"] < health["requests"]
    with pytest.raises(qgraph.RemoteError, match="422.*stages"):  # what stages do not run yet, refused with why
        ig.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)
    assert httpx.get(f"{url}/v1/health").status_code == 200


def test_sigterm_to_torchrun_ends_every_rank(staged_server):
    process, url, marker = staged_server
    process.send_signal(signal.SIGTERM)
    process.wait(90)
    deadline = time.monotonic() + 30
    while _processes_naming(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_naming(marker) == []
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/v1/health", timeout=2)
