"""Check qgraph's core equalities on a CUDA device, then time it on the 0.8B shape.

    python benchmarks/gpu_check.py [--skip-speed] [--tokens 2048] [--repeats 5]

Without a CUDA device it says so in one line and exits 0. Otherwise every check runs and prints
PASS, FAIL, SKIP or INFO with the worst difference and its tolerance, relative to the reference's
largest |x| (1e-4 in float32, 2e-2 in bfloat16, 5e-2 for compiled bfloat16; qgraph's states kernel
against fla's: 1e-2 and 5e-2); the exit code is 1 if any failed. The checks use the tiny random
Qwen3.5 (``qgraph.testing.tiny_qwen3_5``, 3 DeltaNet blocks and 1 attention block) in float32
and bfloat16:
- values: every ``layers.{i}.layer_output`` against a forward hook on ``model.model.layers[i]``,
  the logits against the plain HF forward;
- states: the program's delta-rule op runs the kernel transformers picked (fla's or its torch
  one); the last of ``layers.*.linear_attn.states`` == ``state_output``; ``state_output`` (with
  and without states asked) == the recurrent state in HF's cache after ``use_cache=True``. When
  flash-linear-attention (``fla``) is importable, values and states run again in a subprocess that
  hides ``fla``, so that transformers falls back to its torch kernels;
- edits: ``Zero(positions=)`` and ``Add(v)`` at ``layers.1.layer_output``, ``Zero(heads=)`` at
  the attention block's ``attention_head_outputs``, each against a hook doing the same;
- generate: ``ig.generate`` greedy == HF ``model.generate`` greedy (float32; in bfloat16 an INFO
  line, since a near-tie may flip an argmax);
- compile: ``instrument(..., compile=True)`` against the eager program;
- stages: ``stages=2`` in one process against the unsplit program; ``Stages(2, devices=["cuda:0",
  "cuda:1"])`` on two GPUs (SKIP with one GPU, or where ``Stages`` has no ``devices`` field);
- capture: ``qgraph.capture`` under ``python -m torch.distributed.run --nproc_per_node <GPUs>``
  (nccl, checked with an all_reduce first) against a capture in this process: manifest, rows, values.
Then the speed table: the 0.8B shape (random weights) in bfloat16, batch 1, ``--tokens`` tokens:
the plain HF forward, qgraph with every layer_output, with every DeltaNet block's states, and
compiled; median of ``--repeats`` after a warm-up, ``torch.cuda.synchronize()`` around each call.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

if "--hide-fla" in sys.argv:  # before transformers is imported: its fallback then picks the torch kernels
    sys.modules["fla"] = None
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py
REL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
COMPILED_REL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
CROSS_KERNEL_REL = {torch.float32: 1e-2, torch.bfloat16: 5e-2}  # qgraph's states kernel vs fla's
CAPTURE_TEXTS = [f"Document {i}: the gated DeltaNet carries a state from token to token." for i in range(12)]
CAPTURE_VALUES = ["layers.*.layer_output", "layers.0.linear_attn.state_output"]
MODELING = "transformers.models.qwen3_5.modeling_qwen3_5"
STREAM = ["layers.*.layer_output"]


class Report:
    """PASS / FAIL / SKIP / INFO lines, each ending with the seconds since the previous one."""

    def __init__(self, tag: str = ""):
        self.tag, self.failures, self.since = tag, 0, time.perf_counter()

    def line(self, status: str, label: str, detail: str) -> None:
        self.failures += status == "FAIL"
        now = time.perf_counter()
        print(f"{status:<5} {self.tag}{label}: {detail} [{now - self.since:.1f} s]", flush=True)
        self.since = now

    def close(self, label: str, pairs, rel: float) -> None:
        """``pairs``: (name, got, reference); PASS when each |got - ref| <= rel * max|ref| (floor 1e-2)."""
        worst = (-1.0, 0.0, 0.0, "nothing")
        for name, got, ref in pairs:
            got, ref = got.detach().float().cpu(), ref.detach().float().cpu()
            if got.shape != ref.shape:
                return self.line("FAIL", label, f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
            diff = (got - ref).abs().max().item() if got.numel() else 0.0
            tol = rel * max(ref.abs().max().item() if ref.numel() else 0.0, 1e-2)
            ratio = diff / tol if math.isfinite(diff) else math.inf
            worst = max(worst, (ratio, diff, tol, name), key=lambda w: w[0])
        ratio, diff, tol, name = worst
        self.line("PASS" if 0 <= ratio <= 1 else "FAIL", label,
                  f"worst |diff| {diff:.2e} at {name} (tol {tol:.1e} = {rel:g} x max|ref|)")

    def equal(self, label: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        if got.shape != ref.shape:
            return self.line("FAIL", label, f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
        wrong = (got.cpu() != ref.cpu()).sum().item()
        self.line("PASS" if wrong == 0 else "FAIL", label, f"{wrong} of {got.numel()} differ (tol 0)")


def guarded(r, label: str, check, *args):
    """Run one check; an exception is a FAIL (with where it was raised) and the next checks still run."""
    try:
        return check(r, *args)
    except Exception as error:  # noqa: BLE001 (report it and go on)
        where = traceback.extract_tb(error.__traceback__)[-1]
        r.line("FAIL", label, f"raised {type(error).__name__}: {str(error)[:400]} ({where.filename}:{where.lineno})")
        return None


def fla_version() -> str | None:
    if sys.modules.get("fla", ...) is None or importlib.util.find_spec("fla") is None:
        return None
    try:
        return importlib.metadata.version("flash-linear-attention")
    except importlib.metadata.PackageNotFoundError:
        return "installed (version unknown)"


def picked_kernels() -> dict:
    """What transformers' Qwen3.5 DeltaNet runs: each kernel function's ``implementation`` (a closure
    variable of ``use_kernel_func_from_hub_with_fallback``'s wrapper), fla's or its own torch one."""
    module = importlib.import_module(MODELING)
    picked = {}
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn"):
        function = getattr(module, name, None)
        cells = dict(zip(getattr(function, "__code__", None) and function.__code__.co_freevars or (),
                         getattr(function, "__closure__", None) or ()))
        try:
            function = cells["implementation"].cell_contents
        except (KeyError, ValueError):
            pass
        picked[name] = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)}"
    return picked


def load_tiny(path, device, dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def hooked(module, function):
    """A forward hook replacing ``module``'s output (the first element of a tuple) by ``function(output)``."""
    def hook(_, __, out):
        return (function(out[0]), *out[1:]) if isinstance(out, tuple) else function(out)
    return module.register_forward_hook(hook)


def recurrent_state(cache, layer: int) -> torch.Tensor:
    """A DeltaNet block's recurrent state from HF's cache (its API moved across 5.x releases)."""
    if hasattr(cache, "get_recurrent_state"):
        return cache.get_recurrent_state(layer, state_idx=0)
    if hasattr(cache, "layers") and hasattr(cache.layers[layer], "recurrent_states"):
        return cache.layers[layer].recurrent_states
    return cache.recurrent_states[layer]


def against(eager: dict, out) -> list:
    """(name, out's tensor, eager's) for every value of ``eager`` (the logits too)."""
    return [(name, out.logits if name == "logits" else out[name], value) for name, value in eager.items()]


@torch.no_grad()
def check_values(r, qgraph, model, ids, dtype) -> dict:
    seen = {}
    keep = lambda i: lambda m, a, out: seen.__setitem__(i, out[0] if isinstance(out, tuple) else out)  # noqa: E731
    handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    try:
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    finally:
        for handle in handles:
            handle.remove()
    out = qgraph.instrument(model, values=STREAM)(ids, torch.ones_like(ids))
    r.close("values: layer_output vs forward hooks",
            [(f"layers.{i}", out[f"layers.{i}.layer_output"], seen[i]) for i in sorted(seen)], REL[dtype])
    r.close("values: logits vs plain HF forward", [("logits", out.logits, logits)], REL[dtype])
    return {"logits": out.logits, **out.values}


@torch.no_grad()
def check_states(r, qgraph, model, ids, dtype) -> None:
    from qgraph.kernels.ops import KERNELS
    delta = [i for i, kind in enumerate(model.config.layer_types) if kind == "linear_attention"]
    hf = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    cached = {i: recurrent_state(getattr(hf, "cache", None) or hf.past_key_values, i) for i in delta}
    plain = qgraph.instrument(model, values=["layers.*.linear_attn.state_output"])(ids)
    states = qgraph.instrument(model, values=["layers.*.linear_attn.states", "layers.*.linear_attn.state_output"])(ids)
    kernel = picked_kernels()["torch_chunk_gated_delta_rule"]
    chunk = importlib.import_module(MODELING).torch_chunk_gated_delta_rule
    r.line("PASS" if any(k.get("chunk") is chunk for k in KERNELS.values()) else "FAIL",
           "states: the program's delta-rule op runs transformers' pick", kernel)
    rel = REL[dtype]
    # asking for states swaps the model's kernel for qgraph's chunked torch kernel: against fla's, a looser tolerance
    cross = rel if kernel.startswith(MODELING) else CROSS_KERNEL_REL[dtype]
    r.close("states: last of states == state_output", [(f"layers.{i}", states[f"layers.{i}.linear_attn.states"][:, -1],
                                                        states[f"layers.{i}.linear_attn.state_output"]) for i in delta],
            rel)
    r.close("states: state_output (model's kernel) vs HF cache",
            [(f"layers.{i}", plain[f"layers.{i}.linear_attn.state_output"], cached[i]) for i in delta], rel)
    r.close("states: state_output (states kernel) vs HF cache",
            [(f"layers.{i}", states[f"layers.{i}.linear_attn.state_output"], cached[i]) for i in delta], cross)
    r.close("states: logits with states vs without", [("logits", states.logits, plain.logits)], cross)


@torch.no_grad()
def check_edits(r, qgraph, model, ids, dtype) -> None:
    config, layers = model.config, model.model.layers
    attention = config.layer_types.index("full_attention")
    vector = torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(1)).to(ids.device, dtype)
    head, width = 1, config.head_dim

    def zero_head(module, args):  # o_proj reads the gated heads: a head zeroed before the gate stays zero
        x = args[0].clone()
        x[..., head * width:(head + 1) * width] = 0
        return (x, *args[1:])

    zero_positions = lambda x: x.index_fill(1, torch.tensor([3, x.shape[1] - 1], device=x.device), 0)  # noqa: E731
    cases = [("layers.1.layer_output", qgraph.Zero(positions=[3, -1]), "Zero(positions=[3, -1])",
              lambda: hooked(layers[1], zero_positions)),
             ("layers.1.layer_output", qgraph.Add(vector), "Add(v)", lambda: hooked(layers[1], lambda x: x + vector)),
             (f"layers.{attention}.self_attn.attention_head_outputs", qgraph.Zero(heads=[head]),
              f"Zero(heads=[{head}])", lambda: layers[attention].self_attn.o_proj.register_forward_pre_hook(zero_head))]
    ig = qgraph.instrument(model, edits=sorted({name for name, *_ in cases}))
    for name, edit, label, hook in cases:
        handle = hook()
        try:
            reference = model(input_ids=ids).logits
        finally:
            handle.remove()
        r.close(f"edits: {label} at {name} vs hook", [("logits", ig(ids, edits={name: edit}).logits, reference)],
                REL[dtype])


@torch.no_grad()
def check_generate(r, qgraph, model, ids, dtype) -> None:
    prompt = ids[:1, :12]
    hf = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
    ours = qgraph.instrument(model).generate(prompt, max_new_tokens=16).sequences
    if dtype == torch.float32:
        return r.equal("generate: ig.generate greedy vs HF generate (tokens)", ours, hf)
    same = ours.shape == hf.shape and bool((ours == hf).all())
    r.line("INFO", "generate: ig.generate greedy vs HF generate", "identical" if same else
           f"differ (not a failure in bfloat16, where a near-tie can flip an argmax): {ours.tolist()} vs {hf.tolist()}")


@torch.no_grad()
def check_compile(r, qgraph, model, ids, dtype, eager: dict) -> None:
    out = qgraph.instrument(model, values=STREAM, compile=True)(ids, torch.ones_like(ids))
    r.close("compile: compile=True vs eager program", against(eager, out), COMPILED_REL[dtype])


@torch.no_grad()
def check_stages(r, qgraph, model, ids, dtype, eager: dict, two_gpus: bool) -> None:
    out = qgraph.instrument(model, values=STREAM, stages=2)(ids, torch.ones_like(ids))
    r.close("stages: stages=2 in one process vs unsplit", against(eager, out), REL[dtype])
    if dtype != torch.float32:
        return None
    if "devices" not in {field.name for field in dataclasses.fields(qgraph.Stages)}:
        return r.line("SKIP", "stages on two devices", "qgraph.Stages has no devices= field in this qgraph")
    if not two_gpus:
        return r.line("SKIP", "stages on two devices", f"{torch.cuda.device_count()} CUDA device(s); needs 2")
    staged = qgraph.instrument(model, values=STREAM, stages=qgraph.Stages(2, devices=["cuda:0", "cuda:1"]))
    r.close("stages: Stages(2, devices=[cuda:0, cuda:1]) vs one device",
            against(eager, staged(ids, torch.ones_like(ids))), REL[dtype])


def equality_checks(r, path, device, only_states: bool = False) -> None:
    import qgraph
    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(0)).to(device)
    prefix = r.tag
    for dtype in (torch.float32, torch.bfloat16):
        r.tag = f"{prefix}[{str(dtype).removeprefix('torch.')}] "
        model = load_tiny(path, device, dtype)
        eager = guarded(r, "values", check_values, qgraph, model, ids, dtype)
        guarded(r, "states", check_states, qgraph, model, ids, dtype)
        if only_states:
            continue
        guarded(r, "edits", check_edits, qgraph, model, ids, dtype)
        guarded(r, "generate", check_generate, qgraph, model, ids, dtype)
        guarded(r, "compile", check_compile, qgraph, model, ids, dtype, eager)
        two = device != "cpu" and torch.cuda.device_count() >= 2  # a fresh model: devices= may move its weights
        guarded(r, "stages", check_stages, qgraph, load_tiny(path, device, dtype), ids, dtype, eager, two)
    r.tag = prefix


def check_without_fla(r, path, device) -> None:
    """Values and states again in a process where ``fla`` cannot be imported (its lines print there)."""
    if fla_version() is None:
        return r.line("SKIP", "states with fla", "flash-linear-attention is not installed: only transformers' torch "
                                                 "kernels ran (pip install flash-linear-attention to check fla's)")
    print("--- values and states again, in a subprocess that hides fla ---", flush=True)
    done = subprocess.run([sys.executable, __file__, "--hide-fla", "--only-states", "--tiny", str(path),
                           "--device", device])
    r.line("PASS" if done.returncode == 0 else "FAIL", "without fla", f"the subprocess exited {done.returncode}")


def capture_worker(path: str, out: str) -> int:
    """One torchrun rank: join the group (nccl on CUDA), check it with an all_reduce, capture."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    import qgraph
    rank, size = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    total = torch.ones(1, device=device)
    dist.all_reduce(total)
    assert total.item() == size, f"all_reduce gave {total.item()}, expected {size}"
    qgraph.capture(load_tiny(path, device, torch.float32), AutoTokenizer.from_pretrained(path), CAPTURE_TEXTS,
                   values=CAPTURE_VALUES, out=out, context=32, batch_size=2, dtype=torch.float32, progress=False)
    dist.destroy_process_group()
    return 0


def check_capture(r, path, device, processes: int) -> None:
    import qgraph
    from transformers import AutoTokenizer
    folder = Path(path).parent / "capture"  # beside the tiny checkpoint, in main's scratch dir
    label = f"capture under torchrun ({processes} x {'gloo' if device == 'cpu' else 'nccl'})"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(processes), __file__, "--capture-worker", str(path), str(folder / "torchrun")],
                          capture_output=True, text=True, timeout=900)
    if done.returncode:
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        return r.line("FAIL", label, f"exit {done.returncode}: {tail}")
    qgraph.capture(load_tiny(path, device, torch.float32), AutoTokenizer.from_pretrained(path), CAPTURE_TEXTS,
                   values=CAPTURE_VALUES, out=folder / "one", context=32, batch_size=2, dtype=torch.float32,
                   progress=False)
    spread, one = qgraph.load_capture(folder / "torchrun"), qgraph.load_capture(folder / "one")
    manifest = json.loads((folder / "torchrun" / "manifest.json").read_text())
    ranks, world = sorted({shard["rank"] for shard in manifest["shards"]}), manifest["identity"]["world_size"]
    facts = f"rows {manifest['rows']} (one process: {len(one)}), tokens {manifest['tokens']}, world_size {world}, " \
            f"shard ranks {ranks}"
    good = (manifest["rows"], len(spread), world, ranks) == (len(one), len(one), processes,
                                                             list(range(min(processes, len(one)))))
    r.line("PASS" if good else "FAIL", f"{label}: manifest", facts)
    if not good:
        return None
    rows = [(spread[i], one[i]) for i in range(len(one))]
    r.equal("capture: input_ids vs one process (tokens)", torch.stack([a["input_ids"] for a, _ in rows]),
            torch.stack([b["input_ids"] for _, b in rows]))
    names = [name for name in rows[0][1] if name.startswith("layers.")]
    r.close("capture: values vs one process",
            [(f"row {i} {name}", a[name], b[name]) for i, (a, b) in enumerate(rows) for name in names],
            REL[torch.float32])


@torch.no_grad()
def speed(r, args) -> None:
    import qgraph
    from common import build_0_8b, interleaved
    model = build_0_8b().to("cuda", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.cuda()
    calls = {"plain HF forward": lambda: model(input_ids=ids, use_cache=False)}
    for name, values, compile in (("qgraph, every layer_output", STREAM, False),
                                  ("qgraph, every DeltaNet block's states", ["layers.*.linear_attn.states"], False),
                                  ("qgraph compiled, every layer_output", STREAM, True)):
        calls[name] = functools.partial(qgraph.instrument(model, values=values, compile=compile), ids)
    runs, peaks = {}, {}
    for name, call in calls.items():  # a first call each (compiles), alone, for its peak memory
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()  # the weights, and what earlier programs keep (states buffers)
        try:
            call()
            torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError:
            peaks[name] = "OOM"
            r.line("INFO", f"speed: {name}", "out of GPU memory: left out of the table")
            continue
        peaks[name] = f"{(torch.cuda.max_memory_allocated() - before) / 2**30:.1f}"
        runs[name] = lambda call=call: (call(), torch.cuda.synchronize())
    seconds = interleaved(runs, repeats=args.repeats, warmup=1)
    plain = seconds.get("plain HF forward")
    print(f"\nspeed: 0.8B shape (random weights), bfloat16, batch 1, {args.tokens} tokens, median of {args.repeats} "
          f"(+peak GiB: above what was allocated before the call)")
    print(f"{'run':<40}{'median ms':>11}{'x plain':>9}{'+peak GiB':>11}")
    for name in calls:
        median = f"{seconds[name] * 1e3:.1f}" if name in seconds else "-"
        ratio = f"{seconds[name] / plain:.2f}" if name in seconds and plain else "-"
        print(f"{name:<40}{median:>11}{ratio:>9}{peaks[name]:>11}")


def header(device: str) -> None:
    import transformers

    import qgraph
    where = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if device != "cpu" else "CPU"
    print(f"gpu_check on {where}: torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
          f"{transformers.__version__}, qgraph {qgraph.__version__}, fla {fla_version() or 'not installed'}")
    for name, picked in picked_kernels().items():
        print(f"  transformers' {name} runs {picked}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-speed", action="store_true", help="run the checks only")
    parser.add_argument("--tokens", type=int, default=2048, help="the speed table's prompt length")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per row (their median)")
    hidden = argparse.SUPPRESS
    parser.add_argument("--device", default="cuda", help=hidden)  # cpu: the equality checks on CPU, no speed table
    parser.add_argument("--capture-processes", type=int, default=0, help=hidden)  # with --device cpu: gloo capture
    parser.add_argument("--hide-fla", action="store_true", help=hidden)  # acted on at import
    parser.add_argument("--only-states", action="store_true", help=hidden)  # the subprocess of check_without_fla
    parser.add_argument("--tiny", help=hidden)
    parser.add_argument("--capture-worker", nargs=2, metavar=("TINY", "OUT"), help=hidden)  # one torchrun rank
    args = parser.parse_args()
    if args.capture_worker:
        return capture_worker(*args.capture_worker)
    if args.device != "cpu" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}); nothing checked.")
        return 0
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    os.environ.setdefault("QGRAPH_PROGRESS", "0")
    r = Report("[no fla] " if args.hide_fla else "")
    if args.only_states:
        print(f"{r.tag}transformers' kernels: {picked_kernels()}", flush=True)
        equality_checks(r, args.tiny, args.device, only_states=True)
        return 1 if r.failures else 0
    from qgraph.testing import tiny_qwen3_5
    header(args.device)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        path = tiny_qwen3_5(Path(scratch) / "tiny")
        equality_checks(r, path, args.device)
        check_without_fla(r, path, args.device)
        processes = torch.cuda.device_count() if args.device != "cpu" else args.capture_processes
        if processes:
            guarded(r, "capture under torchrun", check_capture, path, args.device, processes)
        else:
            r.line("SKIP", "capture under torchrun", "--device cpu (add --capture-processes 2 to try it on gloo)")
    if args.device != "cpu" and not args.skip_speed:
        guarded(r, "speed table", speed, args)
    print(f"\n{r.failures} check(s) failed" if r.failures else "\nall checks passed")
    return 1 if r.failures else 0


if __name__ == "__main__":
    sys.exit(main())
