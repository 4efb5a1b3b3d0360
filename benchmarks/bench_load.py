"""Loading time and memory of a saved program against its size (issue 53): hostile graphs grown to N nodes.

    python benchmarks/bench_load.py [--nodes 10000,50000,150000] [--floods add,fresh,sizes,matmul]
                                    [--legit 24] [--largest 600] [--keep DIR]

A base program is saved from the tiny checkpoint (``qgraph.testing.tiny_qwen3_5``: one value, one edit
slot, 571 nodes), then its ``graph.json`` is grown as an attacker would, by nodes inserted before the
output (the last one returned), each flood valid node by node:

- ``add``: a chain of ``aten.add.Tensor`` on one small tensor (every node one kind of call: the fake run's
  per-kind reuse serves all but the first);
- ``fresh``: ``aten.zeros`` of N distinct static sizes (every node a new kind: one fake call each);
- ``sizes``: the call's length plus 1, 2, 3, ... (``operator.add`` on a symbolic size) and a tensor of
  each (every node a new kind and a new symbolic expression);
- ``matmul``: ``aten.matmul`` of a [1, 2, length, 16] tensor by a [16, i] one, i = 1, 2, ... (a Python
  decomposition on symbolic sizes, one per node pair);
- ``norm``, ``onehot``, ``repeat``: ``aten.norm`` (p = 1.001, 1.002, ...), ``aten.one_hot`` (i classes) and
  ``aten.repeat_interleave`` (i repeats) of one tensor of the call's length: the costliest kinds of fake
  call found (11, 59 and 15 ops of their decompositions), each node a kind of its own.

``--largest K`` adds the largest graphs ``saved.budget`` allows: ``NODES`` nodes (the base program and a
chain of adds), and the same with K of those nodes norms (each a fake call, K within its ``CALLS``/``OPS``).

Each file is loaded (``qgraph.load``, weights from the ``.safetensors`` beside it; ``qgraph check`` runs
the same checks) in a fresh process that first loads the base program (imports and the fake-tensor
machinery warm, not counted). Printed per file: nodes, ``graph.json`` bytes, wall and CPU seconds of the
load, the process's peak RSS during the load over its RSS before it (Linux's
VmHWM, reset before the load), and whether it loaded or was refused
(and where). ``--legit B`` also saves the tiny architecture grown to B blocks (``num_hidden_layers=B``, its
layer pattern repeated) with every value (``"**"`` and the DeltaNet values asked for by name) and an edit
slot at every editable value, and loads it the same way: the graph of the 0.8B shape at B=24 (node
counts do not depend on the width).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # this checkout's qgraph, not an installed one
sys.path.insert(0, str(ROOT))
OPS = "torch.ops.aten"
FLOAT = {"dtype": {"dtype": "float32"}}


def flood(data: dict, kind: str, count: int) -> list[dict]:
    """``count`` nodes (about) of the flood ``kind``, to insert before ``data``'s output."""
    new: list[dict] = []

    def call(target, *args, **kwargs):
        new.append({"name": f"flood{len(new)}", "op": "call_function", "target": target, "args": list(args),
                    **({"kwargs": kwargs} if kwargs else {})})
        return {"node": new[-1]["name"]}

    places = [n for n in data["graph"]["nodes"] if n["op"] == "placeholder"]
    ids = places[[item.get("input") for item in data["inputs"]].index(0)]["name"]
    length = call(f"{OPS}.sym_size.int", {"node": ids}, 1)
    if kind == "add":
        x = call(f"{OPS}.zeros.default", [4], **FLOAT)
        while len(new) < count:
            x = call(f"{OPS}.add.Tensor", x, x)
    elif kind == "fresh":
        while len(new) < count:
            call(f"{OPS}.zeros.default", [len(new)], **FLOAT)
    elif kind == "sizes":
        size = length
        while len(new) < count:
            size = call("operator.add", size, 1)
            call(f"{OPS}.zeros.default", [size], **FLOAT)
    elif kind == "matmul":
        x = call(f"{OPS}.zeros.default", [1, 2, length, 16], **FLOAT)
        while len(new) < count:
            call(f"{OPS}.matmul.default", x, call(f"{OPS}.zeros.default", [16, len(new)], **FLOAT))
    elif kind in ("norm", "onehot", "repeat"):  # the costliest kinds found, each a literal apart
        x = call(f"{OPS}.zeros.default", [1, 2, length, 16], **FLOAT)
        labels = call(f"{OPS}.zeros.default", [1, length], dtype={"dtype": "int64"})
        while len(new) < count:
            if kind == "norm":
                call(f"{OPS}.norm.ScalarOpt_dim", x, 1 + len(new) / 1000, [3])
            elif kind == "onehot":
                call(f"{OPS}.one_hot.default", labels, len(new))
            else:
                call(f"{OPS}.repeat_interleave.self_int", x, len(new), 3)
    elif kind.startswith("largest"):  # the most nodes allowed: norms to the fake run's budget, then adds
        norms, fill = (0, count) if kind == "largest" else (int(kind.split("-")[1]), count)
        x = call(f"{OPS}.zeros.default", [1, 2, length, 16], **FLOAT)
        for index in range(norms):
            call(f"{OPS}.norm.ScalarOpt_dim", x, 1 + index / 1000, [3])
        x = call(f"{OPS}.zeros.default", [4], **FLOAT)
        while len(new) < fill:
            x = call(f"{OPS}.add.Tensor", x, x)
    else:
        raise ValueError(f"no flood {kind!r}")
    return new


def grown(base: Path, out: Path, kind: str, count: int) -> Path:
    """A copy of the program ``base`` at ``out`` (its weights file beside it) with a flood inserted."""
    with zipfile.ZipFile(base) as source, zipfile.ZipFile(out, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename == "graph.json":
                graph = json.loads(data)
                nodes = graph["graph"]["nodes"]
                output = nodes.pop()
                nodes.extend(flood(graph, kind, count))
                output["args"][0]["tuple"].append({"node": nodes[-1]["name"]})
                nodes.append(output)
                data = json.dumps(graph).encode()
            target.writestr(item, data)
    weights = base.with_suffix(".safetensors")
    out.with_suffix(".safetensors").write_bytes(weights.read_bytes())
    return out


def child(base: Path, path: Path) -> None:
    """Load ``base`` (warm-up), then ``path``; print one JSON line of what it cost."""
    import gc

    import qgraph
    from qgraph.errors import SavedProgramError
    assert Path(qgraph.__file__).is_relative_to(ROOT), qgraph.__file__
    qgraph.load(base)
    gc.collect()
    rss = _peak_reset()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        qgraph.load(path)
        result = "loaded"
    except SavedProgramError as error:
        result = "refused: " + str(error).split(": ", 1)[-1][:120]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    grew = (_peak() - rss) / 2**20
    print(json.dumps({"wall": wall, "cpu": cpu, "peak_mib": grew, "result": result}))


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS: now, VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_reset() -> int:
    """Reset the process's peak RSS to its RSS now (Linux: 5 into clear_refs) and return that."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _peak() -> int:
    return _status("VmHWM")


def measure(base: Path, path: Path, timeout: int) -> dict:
    with zipfile.ZipFile(path) as archive:
        nodes = len(json.loads(archive.read("graph.json"))["graph"]["nodes"])
        size = archive.getinfo("graph.json").file_size
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, "--child", str(base), str(path)], capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, "QGRAPH_PROGRESS": "0",
                                   "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
        line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        found = json.loads(line) if line.startswith("{") else {"result": f"failed: {done.stderr[-300:]}"}
    except subprocess.TimeoutExpired:
        found = {"wall": time.perf_counter() - start, "result": f"still running after {timeout} s (killed)"}
    return {"file": path.name, "nodes": nodes, "bytes": size, **found}


def legit(folder: Path, blocks: int) -> Path:
    """The tiny architecture at ``blocks`` blocks, every value asked and an edit slot at each editable one."""
    import qgraph
    from qgraph.errors import EditError
    from qgraph.testing import tiny_qwen3_5
    from transformers import AutoModelForCausalLM
    checkpoint = tiny_qwen3_5(folder / f"tiny-{blocks}", num_hidden_layers=blocks,
                              layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (blocks // 4))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    values = ["**", *(f"layers.*.linear_attn.{name}" for name in
                      ("states", "effective_attention", "initial_state_output", "conv_state_input",
                       "conv_state_output"))]
    edits = list(qgraph.instrument(model, values=values).values)
    while True:
        try:
            ig = qgraph.instrument(model, values=values, edits=edits)
            break
        except EditError as error:  # a read-only value: no slot there
            edits.remove(str(error).split("'")[1])
    # a value and its port alias (layers.0.mlp_input and layers.0.mlp.input) are one module's slot, which
    # ig.save does not write twice: one slot per module
    seen, kept = set(), []
    for name in edits:
        if name.replace(".", "_") not in seen:
            seen.add(name.replace(".", "_"))
            kept.append(name)
    ig = qgraph.instrument(model, values=values, edits=kept)
    return ig.save(folder / f"legit-{blocks}.qgraph", weights=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", default="10000,50000,150000")
    parser.add_argument("--floods", default="add,fresh,sizes,matmul")
    parser.add_argument("--legit", type=int, default=0, help="also a program of this many blocks, every value")
    parser.add_argument("--largest", type=int, default=0, help="also the largest graphs allowed: NODES nodes of one "
                        "kind, and of them this many norms (each a kind of its own)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a load may take before it is killed")
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    import qgraph
    from qgraph.testing import tiny_qwen3_5
    from transformers import AutoModelForCausalLM
    with tempfile.TemporaryDirectory() as temp:
        folder = args.keep or Path(temp)
        folder.mkdir(parents=True, exist_ok=True)
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5(folder / "tiny"), attn_implementation="sdpa")
        base = qgraph.instrument(model.eval(), values=["layers.1.layer_output"],
                                 edits=["layers.2.layer_output"]).save(folder / "base.qgraph", weights=True)
        files = [grown(base, folder / f"{kind}-{count}.qgraph", kind, count)
                 for count in map(int, args.nodes.split(",")) for kind in args.floods.split(",") if kind]
        if args.largest:
            from qgraph.saved.budget import NODES
            with zipfile.ZipFile(base) as archive:
                fill = NODES - len(json.loads(archive.read("graph.json"))["graph"]["nodes"])
            files += [grown(base, folder / f"{kind}.qgraph", kind, fill) for kind in ("largest", f"largest-{args.largest}")]
        if args.legit:
            files.insert(0, legit(folder, args.legit))
        print(f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores")
        print(f"{'file':<24}{'nodes':>9}{'graph.json':>12}{'wall s':>9}{'cpu s':>9}{'µs/node':>9}{'peak MiB':>10}"
              f"  result")
        for path in files:
            row = measure(base, path, args.timeout)
            per = row["cpu"] / row["nodes"] * 1e6 if "cpu" in row else float("nan")
            print(f"{row['file']:<24}{row['nodes']:>9,}{row['bytes'] / 2**20:>10.2f}Mi{row.get('wall', 0):>9.2f}"
                  f"{row.get('cpu', float('nan')):>9.2f}{per:>9.0f}{row.get('peak_mib', float('nan')):>10.0f}  "
                  f"{row['result']}", flush=True)
        print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
