"""qgraph against the plain forward, forward hooks and nnsight on the 0.8B shape (issue 7).

    python benchmarks/bench_peers.py [--tokens 128] [--repeats 5] [--state-tokens 256] [--out results.md]

Builds the 0.8B shape (24 blocks, hidden 1024, vocab 248320, random weights, sdpa) and measures,
batch 1, under ``torch.no_grad()``:

* ``instrument()`` cold: the first call in this process with an empty disk cache (``QGRAPH_CACHE``
  is pointed at a fresh temporary directory), i.e. export + save; cold from the disk cache: the
  in-memory cache cleared, the program loaded from the file the first call wrote; warm: the program
  already in memory (median of 5). Also the cache file's size.
* forward times, interleaved in one run (a, b, c, a, b, c, ...; median of ``--repeats`` after a
  warm-up), as ratios to the plain Hugging Face forward: forward hooks capturing every block's
  output; qgraph eager, every ``layer_output``; qgraph eager, every standard value (``*``,
  ``layers.*.*``, ``layers.*.*.*``: no module ports); qgraph compiled (inductor), every
  ``layer_output``; nnsight capturing every block's output, when nnsight is installed.
* memory: the parameter bytes a program holds (its GraphModule's parameters, buffers and tensor
  attributes) and the resident-memory growth of a warm ``instrument()`` of every standard value.
* ``layers.*.linear_attn.states`` (every DeltaNet block's state after every token) at
  ``--state-tokens`` against the plain forward at that length, when the states value exists.

Writes a markdown report (``benchmarks/results.md`` by default) with the machine, its load and the
versions, and prints the same table. The sections other benchmarks added to that file (from the
first heading that is not this report's) are kept after it.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

LAYERS = ["layers.*.layer_output"]
STANDARD = ["*", "layers.*.*", "layers.*.*.*"]


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def held_tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of the tensors a GraphModule holds itself: parameters, buffers, tensor attributes."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    for submodule in module.modules():
        tensors.update({id(v): v for v in vars(submodule).values() if isinstance(v, torch.Tensor)})
    return sum(t.untyped_storage().nbytes() for t in tensors.values())


def machine() -> dict:
    memory = next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    info = {"cpus (nproc)": subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip(),
            "RAM": f"{int(memory) / 2**20:.1f} GiB", "CPU": _cpu_name(), "python": platform.python_version(),
            "torch": torch.__version__, "torch threads": str(torch.get_num_threads())}
    import transformers
    info["transformers"] = transformers.__version__
    try:
        import nnsight
        info["nnsight"] = nnsight.__version__
    except ImportError:
        info["nnsight"] = "not installed"
    return info


def _cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def timed(function):
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--state-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results.md")))
    parser.add_argument("--no-states", action="store_true")
    args = parser.parse_args()

    cache_dir = tempfile.mkdtemp(prefix="qgraph-bench-cache-")
    os.environ["QGRAPH_CACHE"] = cache_dir  # an empty disk cache: the first instrument() exports
    os.environ.pop("QGRAPH_PROGRAM_CACHE", None)
    import qgraph
    from qgraph.export import trace as qgraph_export
    from common import build_0_8b, interleaved

    report = {"load at start": load()}
    model, build_seconds = timed(build_0_8b)
    parameters_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    blocks = model.config.num_hidden_layers
    print(f"0.8B shape built in {build_seconds:.0f} s: {blocks} blocks, {parameters_mib:.0f} MiB of parameters")

    # -- instrument(): cold, cold from the disk cache, warm ---------------------------------------
    ig_layers, cold = timed(lambda: qgraph.instrument(model, values=LAYERS))
    export_seconds = ig_layers.exported.seconds
    files = list(Path(cache_dir, "programs").glob("*.json"))
    file_mib = files[0].stat().st_size / 2**20 if files else float("nan")
    qgraph_export._CACHE.pop(model, None)  # as a new process would: only the disk cache knows the program
    ig_loaded, cold_disk = timed(lambda: qgraph.instrument(model, values=LAYERS))
    assert ig_loaded.exported.from_cache, "the second instrument() did not load from the disk cache"
    load_seconds = ig_loaded.exported.seconds
    warm_layers = statistics.median(timed(lambda: qgraph.instrument(model, values=LAYERS))[1] for _ in range(5))
    rss_before = rss_mib()
    ig_standard, _ = timed(lambda: qgraph.instrument(model, values=STANDARD))
    rss_growth = rss_mib() - rss_before
    standard_count = len(ig_standard.values)
    with torch.no_grad():
        standard_out = ig_standard(torch.randint(0, 1000, (1, args.tokens)))
        standard_mib = sum(v.numel() * v.element_size() for v in standard_out.values.values()
                           if isinstance(v, torch.Tensor)) / 2**20
        del standard_out
    warm_standard = statistics.median(timed(lambda: qgraph.instrument(model, values=STANDARD))[1] for _ in range(3))
    held = max(held_tensor_bytes(ig.program) for ig in (ig_layers, ig_loaded, ig_standard))
    print(f"instrument(): cold {cold:.1f} s (export {export_seconds:.1f} s + save + build), cold from the disk "
          f"cache {cold_disk:.1f} s (load {load_seconds:.1f} s), warm {warm_layers:.2f} s (every layer_output), "
          f"{warm_standard:.2f} s (every standard value: {len(ig_standard.values)} values); cache file "
          f"{file_mib:.1f} MiB")
    print(f"memory: programs hold {held} bytes of tensors; a warm instrument() of every standard value grew "
          f"resident memory by {rss_growth:.0f} MiB (parameters: {parameters_mib:.0f} MiB)")

    # -- the captures ------------------------------------------------------------------------------
    ids = torch.randint(0, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    layers = model.model.layers
    hooked = {}

    def hook(index):
        def store(module, inputs, output):
            hooked[index] = output if isinstance(output, torch.Tensor) else output[0]
        return store

    def hooks_forward():
        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
        try:
            return model(input_ids=ids)
        finally:
            for handle in handles:
                handle.remove()

    ig_compiled = qgraph.instrument(model, values=LAYERS, compile=True)
    # logits=False: the values only; the program then skips the final norm and lm_head
    ig_values_only = qgraph.instrument(model, values=LAYERS, logits=False)
    ig_compiled_values_only = qgraph.instrument(model, values=LAYERS, logits=False, compile=True)
    runs = {
        "plain HF forward": lambda: model(input_ids=ids),
        "forward hooks, every block output": hooks_forward,
        "qgraph eager, every layer_output": lambda: ig_layers(ids),
        f"qgraph eager, every standard value ({len(ig_standard.values)})": lambda: ig_standard(ids),
        "qgraph compiled, every layer_output": lambda: ig_compiled(ids),
        "qgraph eager, every layer_output, logits=False": lambda: ig_values_only(ids),
        "qgraph compiled, every layer_output, logits=False": lambda: ig_compiled_values_only(ids),
    }
    nnsight_note = _nnsight_runs(model, ids, runs)

    from torch._dynamo.utils import counters
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        hooks_forward()
        eager_out = ig_layers(ids)
        compiled_out, compile_seconds = timed(lambda: ig_compiled(ids))  # compiles
        graphs = counters["stats"]["unique_graphs"]
        for seq in (args.tokens // 2, args.tokens + 7):  # other lengths: no recompile
            ig_compiled(torch.randint(0, 1000, (1, seq)))
        recompiles = counters["stats"]["unique_graphs"] - graphs
        values_only, compile_values_only_seconds = timed(lambda: ig_compiled_values_only(ids))
        checks = {
            "qgraph logits vs plain": max_difference(eager_out.logits, plain),
            "qgraph layer_output vs hooks": max(max_difference(eager_out[f"layers.{i}.layer_output"], hooked[i])
                                                for i in range(blocks)),
            "compiled vs eager qgraph": max(max_difference(compiled_out.values[n], eager_out.values[n])
                                            for n in eager_out.values),
            "compiled vs eager qgraph, relative to each value's largest magnitude": max(
                max_difference(compiled_out.values[n], eager_out.values[n]) / eager_out.values[n].abs().max().item()
                for n in eager_out.values),
            "compiled logits vs plain": max_difference(compiled_out.logits, plain),
            "compiled logits=False vs eager qgraph": max(max_difference(values_only.values[n], eager_out.values[n])
                                                         for n in eager_out.values),
        }
        checks.update(_nnsight_check(runs, eager_out, blocks))
        print(f"compiled: first call (compiling) {compile_seconds:.0f} s ({compile_values_only_seconds:.0f} s for the "
              f"logits=False program); recompiles for 2 other lengths: {recompiles}")
        print("checks (max abs difference): " + ", ".join(f"{k} {v:.1e}" for k, v in checks.items()))
        report["load before timing"] = load()
        times = interleaved(runs, repeats=args.repeats, warmup=1)
        report["load after timing"] = load()

    kernel_share = _delta_rule_share(ig_layers, ids)
    plain_seconds = times["plain HF forward"]
    rows = [(name, seconds, seconds / plain_seconds) for name, seconds in times.items()]
    print(_table(rows))

    # -- states -------------------------------------------------------------------------------------
    states_rows, states_note = [], ""
    if args.no_states:
        states_note = "skipped (--no-states)"
    elif "layers.0.linear_attn.states" not in ig_layers.catalogue:
        states_note = "skipped: this qgraph has no `layers.*.linear_attn.states` value"
    else:
        long_ids = torch.randint(0, 1000, (1, args.state_tokens), generator=torch.Generator().manual_seed(1))
        names = [name for name in ig_layers.catalogue if name.endswith(".linear_attn.states")]  # by name only
        ig_states = qgraph.instrument(model, values=names)
        with torch.no_grad():
            out = ig_states(long_ids)
            size = sum(v.numel() * v.element_size() for v in out.values.values()) / 2**20
            states_note = f"{len(out.values)} DeltaNet blocks, {size:.0f} MiB of float32 states per forward"
            del out
            state_times = interleaved({"plain": lambda: model(input_ids=long_ids),
                                       "states": lambda: ig_states(long_ids)}, repeats=args.repeats, warmup=1)
        states_rows = [(f"plain HF forward, {args.state_tokens} tokens", state_times["plain"], 1.0),
                       (f"qgraph every DeltaNet block's states, {args.state_tokens} tokens", state_times["states"],
                        state_times["states"] / state_times["plain"])]
    report["load at end"] = load()

    table = _table(rows + states_rows)
    print(table)
    Path(args.out).write_text(_markdown(args, machine(), report, table, {
        "build": build_seconds, "cold": cold, "export": export_seconds, "cold_disk": cold_disk,
        "load": load_seconds, "warm_layers": warm_layers, "warm_standard": warm_standard,
        "standard_values": standard_count, "standard_mib": standard_mib, "fault_s_per_gib": first_touch_seconds(),
        "file_mib": file_mib, "held": held, "rss_growth": rss_growth, "parameters_mib": parameters_mib,
        "compile": compile_seconds, "compile_values_only": compile_values_only_seconds, "recompiles": recompiles,
        "blocks": blocks, "kernel_share": kernel_share, "ratios": {name: ratio for name, _, ratio in rows},
        "states_ratio": states_rows[-1][2] if states_rows else None, "state_tokens": args.state_tokens,
    }, checks, nnsight_note, states_note) + _other_sections(Path(args.out)))
    print(f"wrote {args.out}")


OWN_SECTIONS = ("## Machine", "## Forward", "## instrument()", "## Targets (issue 7)", "## Memory")


def _other_sections(path: Path) -> str:
    """The sections other benchmarks wrote into ``path`` (everything from the first heading that is
    not one of this report's), kept after the new report."""
    if not path.exists():
        return ""
    lines = path.read_text().splitlines(keepends=True)
    for index, line in enumerate(lines):
        if line.startswith("## ") and not line.startswith(OWN_SECTIONS):
            return "\n" + "".join(lines[index:])
    return ""


def first_touch_seconds(repeats: int = 3) -> float:
    """Seconds to fill a freshly allocated 1 GiB tensor (median): what fresh memory costs here."""
    spent = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.empty(2**28, dtype=torch.float32).fill_(1.0)
        spent.append(time.perf_counter() - start)
    return statistics.median(spent)


def _delta_rule_share(ig, ids, runs: int = 3) -> float:
    """The share of an eager qgraph forward spent inside the chunked delta-rule kernels (run as
    opaque custom ops, eagerly, compiled or not)."""
    from qgraph.kernels import ops
    table = next(iter(ops.KERNELS.values()))  # the one model's kernels (registered by its export)
    kernel, spent = table["chunk"], []

    def timed_kernel(*args, **kwargs):
        start = time.perf_counter()
        try:
            return kernel(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    table["chunk"] = timed_kernel
    try:
        with torch.no_grad():
            shares = []
            for _ in range(runs):
                spent.clear()
                _, total = timed(lambda: ig(ids))
                shares.append(sum(spent) / total)
    finally:
        table["chunk"] = kernel
    return statistics.median(shares)


def _targets(f) -> list[str]:
    ratios = f["ratios"]

    def row(target, measured, met):
        status = met if isinstance(met, str) else ("met" if met else "not met")
        return f"| {target} | {measured} | {status} |"

    eager = ratios["qgraph eager, every layer_output"]
    standard = next(r for name, r in ratios.items() if name.startswith("qgraph eager, every standard value"))
    compiled = ratios["qgraph compiled, every layer_output"]
    compiled_values = ratios["qgraph compiled, every layer_output, logits=False"]
    return [
        "| target | measured | |", "|---|---|---|",
        row("eager, every layer_output ≤ 1.05× plain", f"{eager:.3f}×", eager <= 1.05),
        row("eager, every standard value ≤ 1.3× plain", f"{standard:.3f}×", standard <= 1.3),
        row("compiled, every layer_output ≤ 0.8× plain", f"{compiled_values:.3f}× capturing the values only "
            f"(logits=False; eager: {ratios['qgraph eager, every layer_output, logits=False']:.3f}×); "
            f"{compiled:.3f}× returning the logits as well",
            f"{'met' if compiled_values <= 0.8 else 'not met'} for the capture; "
            f"{'met' if compiled <= 0.8 else 'not met'} with the logits too"),
        row("instrument() ≤ 10 s cold (24 blocks)", f"{f['cold']:.1f} s exporting; {f['cold_disk']:.1f} s from the "
            f"disk cache", f"{'met' if f['cold'] <= 10 else 'not met'} exporting; "
                           f"{'met' if f['cold_disk'] <= 10 else 'not met'} from the disk cache"),
        row("instrument() ≤ 1 s warm", f"{f['warm_layers']:.2f} s (every layer_output); {f['warm_standard']:.2f} s "
            f"(every standard value)", f"{'met' if f['warm_layers'] <= 1 else 'not met'} (every layer_output); "
                                       f"{'met' if f['warm_standard'] <= 1 else 'not met'} (every standard value)"),
        *([row(f"states on every DeltaNet block ≤ 1.5× plain ({f['state_tokens']} tokens; issue 4)",
               f"{f['states_ratio']:.3f}×", f["states_ratio"] <= 1.5),
           row(f"states on every DeltaNet block ≤ 1.2× plain ({f['state_tokens']} tokens; issue 14 item 7)",
               f"{f['states_ratio']:.3f}×", f["states_ratio"] <= 1.2)] if f.get("states_ratio") else []),
        row("no weight copied", f"programs hold {f['held']} bytes of tensors; +{f['rss_growth']:.0f} MiB resident "
            f"for a warm instrument()", f["held"] == 0),
    ]


_NNSIGHT = {}


def _nnsight_runs(model, ids, runs) -> str:
    try:
        from nnsight import NNsight
    except ImportError:
        return "nnsight is not installed (`pip install nnsight torch==2.13.0`): its rows are left out."
    wrapped = NNsight(model)
    blocks = model.config.num_hidden_layers

    def nnsight_forward():
        saved = []
        with wrapped.trace(input_ids=ids):
            for index in range(blocks):
                saved.append(wrapped.model.layers[index].output.save())
            logits = wrapped.output.save()
        _NNSIGHT["saved"], _NNSIGHT["logits"] = saved, logits
        return logits

    runs["nnsight, every block output"] = nnsight_forward
    import nnsight
    return f"nnsight {nnsight.__version__}: `NNsight(model).trace(input_ids=...)` saving `model.layers[i].output` " \
           f"for every block and the output."


def _nnsight_check(runs, eager_out, blocks) -> dict:
    if "nnsight, every block output" not in runs:
        return {}
    runs["nnsight, every block output"]()
    return {"nnsight block outputs vs qgraph": max(
        max_difference(_NNSIGHT["saved"][i], eager_out[f"layers.{i}.layer_output"]) for i in range(blocks))}


def _table(rows) -> str:
    lines = ["| capture | median ms | × plain |", "|---|---:|---:|"]
    lines += [f"| {name} | {seconds * 1e3:.0f} | {ratio:.3f} |" for name, seconds, ratio in rows]
    return "\n".join(lines)


def _markdown(args, info, report, table, figures, checks, nnsight_note, states_note) -> str:
    f = figures
    lines = [
        "# Benchmarks: qgraph against the plain forward, hooks and nnsight",
        "",
        f"`python benchmarks/bench_peers.py --tokens {args.tokens} --repeats {args.repeats} "
        f"--state-tokens {args.state_tokens}`, on {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        "0.8B shape (Qwen3.5-0.8B's config: 24 blocks, hidden 1024, vocab 248320), random weights, float32, "
        "sdpa, batch 1, under `torch.no_grad()`. Forward times are interleaved in one run (each capture in "
        f"turn), median of {args.repeats} after a warm-up.",
        "",
        "## Machine",
        "",
        *[f"- {key}: {value}" for key, value in info.items()],
        *[f"- load average (1, 5, 15 min) {key}: {value}" for key, value in report.items()],
        "",
        f"## Forward, {args.tokens} tokens",
        "",
        table,
        "",
        "Checks (max abs difference): " + ", ".join(f"{k} {v:.1e}" for k, v in checks.items()) + ".",
        "",
        f"Every standard value: each call returns {f['standard_mib']:.0f} MiB of tensors in fresh memory, which "
        f"the kernel faults in page by page ({f['fault_s_per_gib']:.2f} s per GiB here, filling a fresh 1 GiB tensor): "
        f"most of that row's overhead, and "
        f"it varies with the allocator's state, so the row moves more than the others between runs.",
        "",
        f"Compiled: the first call compiles (inductor, {f['compile']:.0f} s here, {f['compile_values_only']:.0f} s "
        f"for the logits=False program; the inductor cache in /tmp may already have held kernels); "
        f"{f['recompiles']} recompiles for two other prompt lengths. `logits=False` rows: the program returns the "
        f"values only and skips the final norm and lm_head (248320 x 1024), which the plain forward computes.",
        "",
        f"nnsight: {nnsight_note}",
        "",
        f"States: {states_note}. The timed calls drop their states before the next call, so each writes its "
        f"states into the memory the previous call's used (`qgraph.kernels.buffers.BufferPool`); "
        f"`benchmarks/bench_states.py` measures the peak memory of a forward that allocates them afresh.",
        "",
        "## instrument()",
        "",
        f"- cold (first call in the process, empty disk cache: export + save + build): {f['cold']:.1f} s "
        f"(export {f['export']:.1f} s: one block of each kind traced, then repeated; see `qgraph/repeat.py`)",
        f"- cold from the disk cache (in-memory cache cleared, program loaded from `$QGRAPH_CACHE/programs`): "
        f"{f['cold_disk']:.1f} s (load {f['load']:.1f} s)",
        f"- warm (program in memory), every layer_output: {f['warm_layers']:.2f} s (median of 5)",
        f"- warm, every standard value ({f['standard_values']} values): {f['warm_standard']:.2f} s (median of 3)",
        f"- cache file: {f['file_mib']:.1f} MiB (no weights: placeholders of one element; the parameters are "
        f"{f['parameters_mib']:.0f} MiB)",
        "",
        "## Targets (issue 7)",
        "",
        *_targets(f),
        "",
        f"Why compiling does not speed this forward up: on CPU the forward is matrix products (ATen's mm, which "
        f"inductor calls as well) and the chunked delta rule, which stays an opaque custom op run eagerly "
        f"({f['kernel_share'] * 100:.0f}% of an eager qgraph forward here): what inductor fuses (norms, gates, "
        f"activations, residual adds) is a small share. The logits=False rows gain from skipping the final "
        f"norm and lm_head, compiled or not.",
        "",
        "## Memory",
        "",
        f"- tensors held by the programs' GraphModules (parameters, buffers, tensor attributes): {f['held']} bytes; "
        f"the programs read the model's own parameters at call time",
        f"- resident memory growth of a warm `instrument()` of every standard value: {f['rss_growth']:.0f} MiB "
        f"(graph objects; parameters {f['parameters_mib']:.0f} MiB)",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
