"""Stages: a program cut at block boundaries (``instrument(..., stages=...)``), run in one process (each
stage on its device with ``devices=``) and as a two-process pipeline under torchrun (gloo): logits and
every value equal the single-process program's; an edit on stage 2 changes only what follows it;
``loss=`` runs the backward through the stages, across processes on torch's schedules, and every
parameter's ``.grad`` equals single-process autograd; without ``loss=`` the caller's own backward
reaches the values through micro-batches; a failure on one rank ends both with its error, in bounded time."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qgraph

from conftest import program_cache_on, random_ids

VALUES = ["layers.*.layer_output", "layers.0.linear_attn.states", "layers.3.self_attn.attention_gate"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _shared_program_cache(tmp_path_factory):
    with program_cache_on(tmp_path_factory, "stages-cache"):
        yield


@pytest.fixture(scope="module")
def model(checkpoint):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def single(model):
    return qgraph.instrument(model, values=VALUES, edits=["layers.2.layer_output"])


def _inputs():
    ids = random_ids(3, 11, seed=9)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


EDIT = {"layers.2.layer_output": qgraph.Zero(positions=[-1])}
GRADS = {"layers.*.layer_output": {}, "layers.1.layer_output": {"grad": True}, "layers.3.layer_input": {"grad": True}}
LOSS = lambda logits: logits[:, -1].logsumexp(-1).sum()  # noqa: E731 - summed over the batch (as in stages_worker.py)


def _autograd(model, ids, mask) -> tuple[dict, torch.Tensor]:
    """The HF model's parameter gradients of LOSS, and the loss (the model's .grad left empty)."""
    model.zero_grad(set_to_none=True)
    loss = LOSS(model(input_ids=ids, attention_mask=mask).logits)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads, loss.detach()


def _close(got: dict, expected: dict, atol=1e-5):
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _same(expected: qgraph.Output, logits, values, names, atol=0.0):
    if logits is not None:
        assert (expected.logits - logits).abs().max() <= atol
    for name in names:
        assert (expected[name] - values[name]).abs().max() <= atol, name


def test_in_one_process_stages_give_the_single_program(model, single):
    ids, mask = _inputs()
    expected, edited = single(ids, mask), single(ids, mask, edits=EDIT)
    for stages in (2, [1, 3], qgraph.Stages(4, microbatches=2)):
        staged = qgraph.instrument(model, values=VALUES, edits=["layers.2.layer_output"], stages=stages)
        exact = 0.0 if not isinstance(stages, qgraph.Stages) else 1e-6  # micro-batches: other matmul shapes
        got = staged(ids, mask)
        _same(expected, got.logits, got.values, expected.values, exact)
        got = staged(ids, mask, edits=EDIT)
        _same(edited, got.logits, got.values, edited.values, exact)


@pytest.fixture(scope="module")
def ranks(checkpoint, tmp_path_factory) -> list[dict]:
    """What each rank of tests/stages_worker.py got, run once under torchrun (two processes, gloo)."""
    from qgraph import compat
    refusal = compat.pipelining_refusal(backward=True)
    if refusal is not None:  # what qgraph raises there (test_a_torch_whose_pipelining_cannot_serve_stages_is_named)
        pytest.skip(f"stages across processes need torch.distributed.pipelining to serve them: {refusal}")
    folder = tmp_path_factory.mktemp("ranks")
    ids, mask = _inputs()
    torch.save({"ids": ids, "mask": mask}, folder / "inputs.pt")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "tests" / "stages_worker.py"), str(checkpoint), str(folder / "inputs.pt"), str(folder)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "QGRAPH_PROGRESS": "0"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return [torch.load(folder / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.slow  # two torchrun ranks (python -m pytest -m slow)
def test_two_processes_under_torchrun(model, single, checkpoint, ranks):
    from transformers import AutoModelForCausalLM
    ids, mask = _inputs()
    expected, edited = single(ids, mask), single(ids, mask, edits=EDIT)
    first = ["layers.0.layer_output", "layers.1.layer_output", "layers.0.linear_attn.states"]
    second = ["layers.2.layer_output", "layers.3.layer_output", "layers.3.self_attn.attention_gate"]
    # each rank returns what its stage computed: blocks 0-1 on rank 0, blocks 2-3 and the logits on rank 1
    (logits0, values0), (logits1, values1) = ranks[0]["plain"], ranks[1]["plain"]
    assert logits0 is None and sorted(values0) == sorted(first) and sorted(values1) == sorted(second)
    _same(expected, logits1, values1, second)
    _same(expected, None, values0, first)
    # the edit at block 2 (stage 2): stage 1's values are the plain ones, what follows is edited
    (_, edited0), (edited_logits, edited1) = ranks[0]["edited"], ranks[1]["edited"]
    _same(expected, None, edited0, first)
    _same(edited, edited_logits, edited1, second)
    assert (edited.logits - expected.logits).abs().max() > 1e-3
    # micro-batches of the batch of 3 flow through the stages, every value gathered on rank 0
    gathered_logits, gathered = ranks[0]["gathered"]
    _same(expected, gathered_logits, gathered, first + second, atol=1e-6)
    # built on meta: each rank read only its own blocks' weights, and computes the same
    read0, read1 = ranks[0]["read"], ranks[1]["read"]
    assert any(".layers.1." in name for name in read0) and not any(".layers.2." in name for name in read0)
    assert any(".layers.3." in name for name in read1) and not any(".layers.0." in name for name in read1)
    assert "model.norm.weight" in read1 and "model.norm.weight" not in read0
    _same(expected, ranks[1]["meta"][0], ranks[1]["meta"][1], second)
    _same(expected, None, ranks[0]["meta"][1], first)
    # loss= on torch's schedules through a tied model: each rank's parameters hold the gradients of one process
    tied = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tied.lm_head.weight = tied.model.embed_tokens.weight
    reference, loss = _autograd(tied, ids[:2], mask[:2])
    alone = qgraph.instrument(tied, values=GRADS)(ids[:2], mask[:2], loss=LOSS)
    tied.zero_grad(set_to_none=True)
    for name, blocks in {"gpipe": ({0, 1}, {2, 3}), "1f1b": ({0, 1}, {2, 3}), "interleaved": ({0, 2}, {1, 3})}.items():
        for rank, held in zip((0, 1), blocks):
            grads, value_grads, got_loss, logits, values = ranks[rank][name]
            assert {int(n.split(".")[2]) for n in grads if ".layers." in n} == held, name
            assert "model.embed_tokens.weight" in grads, name  # tied: read on both ranks, its parts summed
            _close(grads, reference)
            _close(value_grads, {n: alone.grad(n) for n in value_grads}, atol=1e-6)
            if got_loss is not None:
                assert abs(got_loss - loss) <= 1e-5
        assert set(ranks[0][name][0]) | set(ranks[1][name][0]) == set(reference)
        assert ranks[1][name][2] is not None and len(ranks[1][name][1]) >= 1
    gathered = ranks[0]["interleaved"]  # gather=True: every value, its gradient and the loss on rank 0
    assert sorted(gathered[1]) == ["layers.1.layer_output", "layers.3.layer_input"] and gathered[2] is not None
    _same(alone, gathered[3], gathered[4], alone.values, atol=1e-5)
    forward = ranks[0]["interleaved forward"]  # forward alone, 3 rows into 2 micro-batches: a step of 2, one of 1
    assert sorted(forward) == sorted([f"layers.{i}.layer_output" for i in range(4)] + ["layers.3.layer_input"])
    _same(expected, None, forward, [f"layers.{i}.layer_output" for i in range(4)], atol=1e-5)


@pytest.mark.slow  # two torchrun ranks (python -m pytest -m slow)
def test_a_failure_on_one_rank_ends_every_rank_with_its_error(ranks):
    # (the call, the error rank 1 raised, its message, its cause, the most seconds either rank took); the worker
    # exits after 120 s left waiting, so a failure that leaves a rank waiting fails this test instead of hanging it
    failed = {
        "weights": ("InvalidState", "is on the meta device", None, 10),  # before its stage ran: the vote at the start
        "loss": ("ValueError", "the loss fails on the last stage", None, 10),  # zeros sent on: at once
        "edit": ("KeyError", "the edit fails on rank 1", None, 10),  # a stage's forward, without loss=: at once
        # in torch's backward: rank 0 waits on rank 1's gradients until Stages(timeout=2) runs out
        "backward": ("RuntimeError", "Failed to run stage backward", "ArithmeticError", 2 * 2 + 10)}
    for name, (kind, text, cause, bound) in failed.items():
        own, other = ranks[1]["failures"][name], ranks[0]["failures"][name]
        assert (own[0], own[2]) == (kind, cause) and text in own[1], (name, own)
        named = text if cause is None else "the backward fails on rank 1"  # torch's wrapper unwrapped
        assert other[0] == "InvalidState" and f"rank 1 failed in a staged call ({cause or kind}: " in other[1], other
        assert named in other[1] and "every rank stops with its error" in other[1], other
        assert own[3] < bound and other[3] < bound, (name, own[3], other[3])
    assert ranks[0]["failures"]["backward"][3] >= 2  # it waited for the timeout: nothing sent on from a backward
    assert ranks[0]["failures"]["loss"][3] < 2  # the loss's failure comes to rank 0 at once, not at a timeout
    # and afterwards the same processes run loss= on torch's schedules exactly (test_two_processes_under_torchrun)


def _hf_block_grads(model, ids, mask, loss, blocks) -> tuple[dict, dict]:
    """HF autograd of ``loss(logits, output of block 1)``: each of ``blocks``' output's gradient (retain_grad
    on its forward hook's output) and the parameters' .grad (the model's .grad left empty)."""
    seen = {}

    def keep(module, args, output, block):
        seen[block] = output[0] if isinstance(output, tuple) else output
        seen[block].retain_grad()

    handles = [model.model.layers[b].register_forward_hook(functools.partial(keep, block=b)) for b in blocks]
    model.zero_grad(set_to_none=True)
    try:
        loss(model(input_ids=ids, attention_mask=mask).logits, seen[1]).backward()
    finally:
        for handle in handles:
            handle.remove()
    params = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {b: seen[b].grad for b in blocks}, params


def test_the_callers_own_backward_reaches_the_values_through_micro_batches(model):
    ids, mask = _inputs()  # 3 rows: micro-batches of 2 and 1
    names = {"layers.1.layer_output": 1, "layers.3.layer_input": 2}  # the HF block whose output each is

    def loss(logits, first):  # the logits of the first micro-batch only, and block 1's output of every row
        return LOSS(logits[:2]) + first[:, -3:].square().sum() * 1e-2

    blocks, params = _hf_block_grads(model, ids, mask, loss, (1, 2))
    assert blocks[2][2].abs().max() == 0 < blocks[2][:2].abs().max()  # the second micro-batch's rows: zeros
    # placed stages (devices=) run the same in-process loop as plain ones, and place each piece too
    stages = qgraph.Stages(2, microbatches=2, devices=["cpu", "cpu"])
    ig = qgraph.instrument(model, values={name: {"grad": True} for name in names}, stages=stages)
    out = ig(ids, mask)
    loss(out.logits, out["layers.1.layer_output"]).backward()  # the caller's own backward, no loss=
    got = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert set(got) == set(params)
    _close(got, params)
    again = ig(ids, mask)  # torch.autograd.grad of the caller's loss: the parameters' .grad untouched
    gradients = again.gradients(loss(again.logits, again["layers.1.layer_output"]))
    assert all(p.grad is None for p in model.parameters())
    for name, block in names.items():
        torch.testing.assert_close(out.grad(name), blocks[block], rtol=0, atol=1e-5)
        torch.testing.assert_close(gradients[name], blocks[block], rtol=0, atol=1e-5)


def test_loss_runs_the_backward_through_the_stages_in_one_process(model):
    ids, mask = _inputs()
    reference, loss = _autograd(model, ids, mask)
    first = None
    for stages in (None, qgraph.Stages(2, microbatches=2)):  # micro-batches of 2 and 1 rows: their losses summed
        out = qgraph.instrument(model, values=GRADS, stages=stages)(ids, mask, loss=LOSS)
        got = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        assert set(got) == set(reference) and abs(out.loss - loss) <= 1e-5
        _close(got, reference)
        first = out if first is None else first
        for name in ("layers.1.layer_output", "layers.3.layer_input"):
            torch.testing.assert_close(out.grad(name), first.grad(name), rtol=0, atol=1e-6)


def test_devices_place_each_stage_in_one_process(model, single):
    ids, mask = _inputs()
    expected = single(ids, mask, edits=EDIT)
    staged = qgraph.instrument(model, values=VALUES, edits=["layers.2.layer_output"],
                               stages=qgraph.Stages([1], devices=["cpu", "cpu"]))
    pipeline = staged.program_for(False).runner.pipeline
    read = {}  # each stage module's tensor arguments: on its own device
    for index, module in enumerate(pipeline.plan.modules):
        module.forward = _recording(module, read.setdefault(index, set()))
    got = staged(ids, mask, edits=EDIT)
    _same(expected, got.logits, got.values, expected.values)
    assert read == {0: {torch.device("cpu")}, 1: {torch.device("cpu")}}
    # a weight on another device than the one stage reading it is refused by name, with the way out
    program = staged.program_for(False)
    args = program.arguments({"input_ids": ids, "attention_mask": mask})
    index = program.input_names.index("p_model_layers_2_mlp_down_proj_weight")
    args[index] = args[index].to("meta")
    with pytest.raises(RuntimeError, match=r"model.layers.2.mlp.down_proj.weight is on meta, but stage 1 reads it on "
                                           r"cpu .* qgraph does not move or copy the model's weights: .*"
                                           r"model.get_submodule\('model.layers.2.mlp.down_proj'\).to\('cpu'\)"):
        pipeline.placement.check(args)


def _recording(module, devices: set):
    """``module``'s forward, noting the devices of the tensors it is given."""
    def forward(*args):
        devices.update(arg.device for arg in args if isinstance(arg, torch.Tensor))
        return type(module).forward(module, *args)
    return forward


@pytest.mark.compat
def test_a_model_on_meta_runs_with_weights_read_from_the_checkpoint(model, single, checkpoint):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model.config).eval()
    ig = qgraph.instrument(meta, values=VALUES, edits=["layers.2.layer_output"])
    ids, mask = _inputs()
    with pytest.raises(RuntimeError, match="is on the meta device .* load them with ig.load_weights"):
        ig(ids, mask)
    names = ig.load_weights(checkpoint)
    assert "model.layers.3.mlp.down_proj.weight" in names and "model.rotary_emb.inv_freq" in names
    expected = single(ids, mask, edits=EDIT)
    got = ig(ids, mask, edits=EDIT)
    _same(expected, got.logits, got.values, expected.values)
    assert all(p.is_meta for p in meta.parameters())  # the model is untouched
    placed = qgraph.instrument(meta, values=VALUES, edits=["layers.2.layer_output"],
                               stages=qgraph.Stages(2, devices=["cpu", "cpu"]))
    with pytest.raises(ValueError, match="devices= places each stage's weights on its device: call load_weights"):
        placed.load_weights(checkpoint, device="cpu")
    placed.load_weights(checkpoint)  # each stage's weights onto its device
    got = placed(ids, mask, edits=EDIT)
    _same(expected, got.logits, got.values, expected.values)
    with pytest.raises(ValueError, match=r"the weights do not fit the model: .* is \(\d+, 64\) float32 there, "
                                         r"\(\d+, 48\) float32 in"):
        from qgraph.testing import tiny_qwen3_5
        ig.load_weights(tiny_qwen3_5(checkpoint.parent / "narrow", hidden_size=48))


def test_a_torch_whose_pipelining_cannot_serve_stages_is_named(model, monkeypatch):
    """Under torchrun on a torch whose schedules refuse fewer micro-batches than stages (2.10), instrument
    raises NotSupported naming it; where its stages cannot send the gradients qgraph's need, loss= does."""
    from qgraph.compat import torch_pipelining
    import qgraph.distributed
    from qgraph.distributed.world import World
    monkeypatch.setattr(qgraph.distributed, "join", lambda device: World(0, 2))  # as rank 0 of 2 would be
    monkeypatch.setattr(torch_pipelining, "_schedules_take_fewer_microbatches_than_stages", lambda: False)
    with pytest.raises(qgraph.NotSupported, match=r"stages across processes \(torchrun\) run on "
                                                  r"torch.distributed.pipelining, and this torch .* refuse fewer "
                                                  r"micro-batches than stages"):
        qgraph.instrument(model, values=VALUES, stages=2)
    monkeypatch.undo()
    monkeypatch.setattr(torch_pipelining, "_schedules_take_fewer_microbatches_than_stages", lambda: True)
    for name in ("_stages_send_only_declared_gradients", "_receive_records_carry_metadata"):
        monkeypatch.setattr(torch_pipelining, name, lambda: False)
    assert torch_pipelining.pipelining_refusal() is None
    assert "want a gradient for every input they receive" in torch_pipelining.pipelining_refusal(backward=True)


def test_stage_mistakes_are_named(model):
    with pytest.raises(ValueError, match="stages=5: a model of 4 blocks splits into 1 to 4 stages"):
        qgraph.instrument(model, values=VALUES, stages=5)
    with pytest.raises(ValueError, match=r"stages=\[3, 1\]: give the first block of each stage after the first, "
                                         r"increasing"):
        qgraph.instrument(model, values=VALUES, stages=[3, 1])
    with pytest.raises(ValueError, match="stages= runs each stage eagerly; drop compile="):
        qgraph.instrument(model, values=VALUES, stages=2, compile=True)
    with pytest.raises(ValueError, match="microbatches takes a positive int"):
        qgraph.Stages(2, microbatches=0)
    with pytest.raises(ValueError, match="timeout= takes the seconds a rank waits on another's message"):
        qgraph.Stages(2, timeout=0)
    for devices, message in ((["cpu"], "devices= names 1 device for 2 stages: give one per stage"),
                             (["cpu", "nowhere"], "devices=: 'nowhere' is not a device"),
                             (["cpu", "meta"], "a stage cannot compute on 'meta'"),
                             ("cpu", "devices= takes one device per stage")):
        with pytest.raises((ValueError, TypeError), match=message):
            qgraph.Stages(2, devices=devices)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="devices=: cuda:7 is not usable here"):
            qgraph.Stages(2, devices=["cpu", "cuda:7"])
    with pytest.raises(ValueError, match="schedule='zigzag': qgraph runs torch's 'gpipe', '1f1b', 'interleaved-1f1b'"):
        qgraph.Stages(2, schedule="zigzag")
    with pytest.raises(ValueError, match="schedule='1f1b' runs at least as many micro-batches as stages"):
        qgraph.Stages(2, schedule="1f1b")
    ig, ids = qgraph.instrument(model, values=VALUES), random_ids(2, 5)
    with pytest.raises(TypeError, match="loss= takes a function of the logits to a scalar, not int"):
        ig(ids, loss=3)
    with pytest.raises(ValueError, match=r"loss= maps the logits to a scalar tensor .* a tensor of shape \(2, 5\)"):
        ig(ids, loss=lambda logits: logits.sum(-1))
    with torch.no_grad(), pytest.raises(RuntimeError, match="loss= runs a backward, which gradients off forbid"):
        ig(ids, loss=LOSS)
    with pytest.raises(ValueError, match="loss= takes a function of the logits to a scalar: instrument with logits="):
        qgraph.instrument(model, values=VALUES, logits=False)(ids, loss=LOSS)
    with pytest.raises(NotImplementedError, match="generate does not run stages yet"):
        qgraph.instrument(model, values=VALUES, stages=2).generate(random_ids(1, 3), max_new_tokens=2)
