"""Generation (issue 8): decoding from the explicit cache, values and edits at every step."""
from __future__ import annotations

import pytest
import torch

import qgraph

from conftest import random_ids

NEW = 8
STREAM = ["layers.0.layer_output", "layers.2.layer_output", "layers.3.layer_output"]
ATTENTION = ["layers.3.self_attn.attention_keys", "layers.3.self_attn.attention_values",
             "layers.3.self_attn.attention_head_outputs"]
DELTA = ["layers.1.linear_attn.attention_head_outputs", "layers.1.linear_attn.state_input",
         "layers.1.linear_attn.state_output", "layers.0.linear_attn.state_input", "layers.0.linear_attn.state_output"]


def hf_generate(model, ids, mask=None, **kwargs):
    mask = torch.ones_like(ids) if mask is None else mask
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kwargs)


@pytest.fixture(scope="module")
def gen_ig(sdpa_model):
    return qgraph.instrument(sdpa_model, values=STREAM + ATTENTION + DELTA, edits=["layers.1.layer_output"])


@pytest.fixture(scope="module")
def prompt():
    return random_ids(1, 12, seed=21)


@pytest.fixture(scope="module")
def padded():
    ids = random_ids(2, 12, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids[0, :4] = 256  # the pad id
    return ids, mask


@pytest.fixture(scope="module")
def generated(gen_ig, prompt):
    return gen_ig.generate(prompt, max_new_tokens=NEW)


@pytest.mark.compat
def test_greedy_ids_equal_hf_generate(sdpa_model, gen_ig, prompt, generated):
    reference = hf_generate(sdpa_model, prompt)
    assert torch.equal(generated.sequences, reference)
    bare = qgraph.instrument(sdpa_model).generate(prompt, max_new_tokens=NEW)  # no captures
    assert torch.equal(bare.sequences, reference)
    assert len(generated.steps) == NEW + 1  # the prompt pass, then one pass per new token
    assert generated.steps[0]["layers.3.layer_output"].shape == (1, 12, 64)
    assert generated.steps[1]["layers[-1].layer_output"].shape == (1, 1, 64)


@pytest.mark.compat
def test_left_padded_batch_equals_hf_generate(sdpa_model, gen_ig, padded):
    ids, mask = padded
    out = gen_ig.generate(ids, mask, max_new_tokens=NEW)
    reference = hf_generate(sdpa_model, ids, mask)
    assert torch.equal(out.sequences, reference)
    assert not torch.equal(out.sequences[0, 12:], out.sequences[1, 12:])


def test_each_step_equals_a_fresh_prompt_pass(gen_ig, prompt, generated):
    length = prompt.shape[1]
    for k, step in enumerate(generated.steps):
        fresh = gen_ig(generated.sequences[:, :length + k])
        torch.testing.assert_close(step.logits[:, -1], fresh.logits[:, -1], atol=1e-5, rtol=0)
        for name in STREAM + DELTA[:1] + ATTENTION[2:]:  # [batch seq ...]
            torch.testing.assert_close(step[name][:, -1], fresh[name][:, -1], atol=1e-5, rtol=0, msg=f"{name} step {k}")
        for name in ATTENTION[:2]:  # [batch kv_heads seq head_dim]
            torch.testing.assert_close(step[name][:, :, -1], fresh[name][:, :, -1], atol=1e-5, rtol=0,
                                       msg=f"{name} step {k}")
        for name in DELTA[2:]:
            if name.endswith("state_output"):
                torch.testing.assert_close(step[name], fresh[name], atol=1e-5, rtol=1e-4, msg=f"{name} step {k}")
    assert generated.steps[3]["layers.3.layer_output"].abs().max() > 0.01  # not comparing zeros


def test_state_input_is_the_previous_state_output(generated):
    for k in range(1, len(generated.steps)):
        for block in (0, 1):
            previous = generated.steps[k - 1][f"layers.{block}.linear_attn.state_output"]
            torch.testing.assert_close(generated.steps[k][f"layers.{block}.linear_attn.state_input"], previous,
                                       atol=0, rtol=0)
    assert generated.steps[0]["layers.0.linear_attn.state_input"].abs().max() == 0  # a prompt starts from zeros
    assert generated.steps[2]["layers.0.linear_attn.state_input"].abs().max() > 1e-3


def test_attention_pattern_and_states_per_step(eager_model, prompt):
    ig = qgraph.instrument(eager_model, values={"layers.3.self_attn.attention_probabilities": None,
                                                "layers.2.linear_attn.states": {}})
    out = ig.generate(prompt, max_new_tokens=4)
    assert torch.equal(out.sequences, hf_generate(eager_model, prompt)[:, :prompt.shape[1] + 4])
    for k, step in enumerate(out.steps):
        fresh = ig(out.sequences[:, :prompt.shape[1] + k])
        pattern = step["layers.3.self_attn.attention_probabilities"]
        assert pattern.shape[-2:] == ((prompt.shape[1], prompt.shape[1]) if k == 0 else (1, prompt.shape[1] + k))
        torch.testing.assert_close(pattern[:, :, -1], fresh["layers.3.self_attn.attention_probabilities"][:, :, -1],
                                   atol=1e-5, rtol=0)
        assert step["layers.2.linear_attn.states"].shape[1] == (prompt.shape[1] if k == 0 else 1)
        torch.testing.assert_close(step["layers.2.linear_attn.states"][:, -1],
                                   fresh["layers.2.linear_attn.states"][:, -1], atol=1e-5, rtol=1e-4)


def test_a_pattern_under_sdpa_generates_as_hf_on_a_padded_batch(sdpa_model, padded):
    # the pattern decomposes that block's sdpa, whose mask reads add 4-D boolean nodes inside the block:
    # the decode pass must still find the one mask outside the blocks
    ig = qgraph.instrument(sdpa_model, values=["layers.3.self_attn.attention_probabilities"])
    ids, mask = padded
    out = ig.generate(ids, mask, max_new_tokens=NEW)
    assert torch.equal(out.sequences, hf_generate(sdpa_model, ids, mask))
    last = out.steps[-1]["layers.3.self_attn.attention_probabilities"]
    full = torch.cat([mask, torch.ones(2, out.sequences.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    fresh = ig(out.sequences[:, :last.shape[-1]], full[:, :last.shape[-1]])
    torch.testing.assert_close(last[:, :, -1], fresh["layers.3.self_attn.attention_probabilities"][:, :, -1],
                               atol=1e-5, rtol=0)


def _hooked(model, layer, vector, calls=None):
    """HF generate with a forward hook adding ``vector`` to a block's output (on the forward calls in
    ``calls``, every call if None)."""
    count = [0]

    def hook(module, args, output):
        call, count[0] = count[0], count[0] + 1
        if calls is None or call in calls:
            return output + vector
        return None
    return model.model.layers[layer].register_forward_hook(hook)


@pytest.mark.parametrize("steps, calls", [(None, None), ([0], {0}), (slice(1, None), set(range(1, 100)))])
@pytest.mark.compat
def test_steering_at_steps_matches_a_hook_on_hf_generate(sdpa_model, gen_ig, prompt, generated, steps, calls):
    vector = 4.0 * torch.randn(64, generator=torch.Generator().manual_seed(7))
    out = gen_ig.generate(prompt, max_new_tokens=NEW, edits={"layers.1.layer_output": qgraph.Add(vector)}, steps=steps)
    handle = _hooked(sdpa_model, 1, vector, calls)
    try:
        reference = hf_generate(sdpa_model, prompt)
    finally:
        handle.remove()
    assert torch.equal(out.sequences, reference)
    assert not torch.equal(out.sequences, generated.sequences)  # the edit changes the reply
    prompt_changed = not torch.allclose(out.steps[0]["layers.3.layer_output"], generated.steps[0]["layers.3.layer_output"])
    assert prompt_changed == (steps != slice(1, None))  # steps=slice(1, None) leaves the prompt pass alone


def test_edits_at_prompt_only_leave_the_decode_steps_unedited(gen_ig, prompt):
    """steps=[0] edits the prompt pass only; a decode step then runs unedited on the edited cache."""
    vector = torch.randn(64, generator=torch.Generator().manual_seed(3))
    edit = {"layers.1.layer_output": qgraph.Add(vector)}
    values = ["layers.1.layer_output", "layers.3.layer_output"]
    at_prompt = gen_ig.generate(prompt, max_new_tokens=3, values=values, edits=edit, steps=[0])
    every = gen_ig.generate(prompt, max_new_tokens=3, values=values, edits=edit)
    replayed = gen_ig(prompt, edits=edit)
    torch.testing.assert_close(at_prompt.steps[0]["layers.3.layer_output"], replayed["layers.3.layer_output"],
                               atol=1e-6, rtol=0)
    # step 1 reads the same token on the same (edited) cache in both runs: only the edit differs
    assert torch.equal(at_prompt.sequences[:, :prompt.shape[1] + 1], every.sequences[:, :prompt.shape[1] + 1])
    torch.testing.assert_close(every.steps[1]["layers.1.layer_output"] - at_prompt.steps[1]["layers.1.layer_output"],
                               vector.expand(1, 1, 64), atol=1e-5, rtol=0)


@pytest.mark.compat
def test_sampling_is_reproducible_and_follows_hf(sdpa_model, gen_ig, prompt):
    settings = dict(max_new_tokens=NEW, do_sample=True, temperature=1.5, top_k=50, top_p=0.95)
    first = gen_ig.generate(prompt, seed=1, **settings)
    again = gen_ig.generate(prompt, seed=1, **settings)
    other = gen_ig.generate(prompt, seed=2, **settings)
    assert torch.equal(first.sequences, again.sequences)
    assert not torch.equal(first.sequences, other.sequences)
    torch.manual_seed(11)  # the global generator, as HF generate samples
    ours = gen_ig.generate(prompt, **settings)
    torch.manual_seed(11)
    with torch.no_grad():
        reference = sdpa_model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    assert torch.equal(ours.sequences, reference)


def test_stops_on_eos(sdpa_model, gen_ig, padded):
    ids, mask = padded
    first = gen_ig.generate(ids, mask, max_new_tokens=NEW)
    eos = int(first.sequences[0, 12])  # row 0's first new token: row 0 stops there, row 1 runs on
    assert eos not in first.sequences[1, 12:].tolist()
    out = gen_ig.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos)
    reference = hf_generate(sdpa_model, ids, mask, eos_token_id=eos)
    assert torch.equal(out.sequences, reference)
    assert out.sequences.shape[1] == 12 + NEW
    assert (out.sequences[0, 13:] == sdpa_model.generation_config.pad_token_id).all()  # a stopped row is padded
    alone = gen_ig.generate(ids[:1], mask[:1], max_new_tokens=NEW, eos_token_id=eos)
    assert alone.sequences.shape[1] == 13 and len(alone.steps) == 2  # all rows done: generation stops



# -- logits and scores: HF generate's output_logits and output_scores (issue 55) -------------------------------

def hf_outputs(model, ids, mask, **settings):
    """HF generate with its per-token raw logits and processed scores."""
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, return_dict_in_generate=True,
                              output_logits=True, output_scores=True, **settings)


def assert_as_hf(out, reference):
    """One logits and one scores entry per new token, each HF's to float32 rounding (a -inf where HF's is)."""
    assert torch.equal(out.sequences, reference.sequences)
    new = out.sequences.shape[1] - 12  # the prompts' length
    assert len(out.logits) == len(out.scores) == len(reference.logits) == len(reference.scores) == new
    for mine, theirs in zip(out.logits + out.scores, reference.logits + reference.scores):
        assert mine.dtype == theirs.dtype == torch.float32 and mine.shape == theirs.shape
        assert torch.equal(mine.isinf(), theirs.isinf())
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.compat
def test_logits_and_scores_equal_hf_greedy_with_and_without_values(sdpa_model, gen_ig, prompt):
    reference = hf_outputs(sdpa_model, prompt, torch.ones_like(prompt), do_sample=False)
    captured = gen_ig.generate(prompt, max_new_tokens=NEW)
    assert_as_hf(captured, reference)
    assert len(captured.steps) == NEW + 1  # values asked: the last new token's pass runs for them
    torch.testing.assert_close(captured.logits[2], captured.steps[2].logits[:, -1].float(), atol=0, rtol=0)
    bare = qgraph.instrument(sdpa_model).generate(prompt, max_new_tokens=NEW)
    assert_as_hf(bare, reference)
    assert len(bare.steps) == NEW and bare.steps[-1].logits.shape[1] == 1  # no values: no pass past the last choice


@pytest.mark.compat
def test_logits_and_scores_equal_hf_when_sampling(sdpa_model, gen_ig, prompt):
    settings = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(5)  # HF samples from the global generator; so does generate without seed=
    ours = gen_ig.generate(prompt, max_new_tokens=NEW, **settings)
    torch.manual_seed(5)
    reference = hf_outputs(sdpa_model, prompt, torch.ones_like(prompt), **settings)
    assert_as_hf(ours, reference)
    finite = ours.scores[0].isfinite().sum(-1)
    assert (finite <= 20).all() and (finite >= 1).all()  # top_k/top_p masked the rest: processed, not raw
    torch.testing.assert_close(ours.scores[0].max(-1).values, ours.logits[0].max(-1).values / 0.7)


@pytest.mark.compat
def test_logits_and_scores_equal_hf_on_a_left_padded_batch(sdpa_model, gen_ig, padded):
    ids, mask = padded
    assert_as_hf(gen_ig.generate(ids, mask, max_new_tokens=NEW), hf_outputs(sdpa_model, ids, mask, do_sample=False))
    eos = int(gen_ig.generate(ids, mask, max_new_tokens=1).sequences[0, 12])
    stopped = hf_outputs(sdpa_model, ids[:1], mask[:1], do_sample=False, eos_token_id=eos)
    assert len(stopped.logits) == 1  # every row done at once: one new token, one entry
    assert_as_hf(qgraph.instrument(sdpa_model).generate(ids[:1], mask[:1], max_new_tokens=NEW, eos_token_id=eos),
                 stopped)


def test_chat_prompt_passes_enable_thinking(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(TypeError):
        qgraph.chat_prompt(tokenizer, messages)  # the flag is required
    closed = qgraph.chat_prompt(tokenizer, messages, enable_thinking=False, tokenize=False)
    opened = qgraph.chat_prompt(tokenizer, messages, enable_thinking=True, tokenize=False)
    assert closed.endswith("<think>\n\n</think>\n\n") and opened.endswith("<think>\n")
    batch = qgraph.chat_prompt(tokenizer, [messages, [{"role": "user", "content": "Hello there"}]],
                               enable_thinking=False)
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][:, -1].all()  # left padded


# -- length arguments and bad arguments (issue 12): HF generate's rules ------------------------------------------

def hf_sequences(model, ids, **kwargs):
    """HF generate, greedy, with exactly these length arguments (no NEW default)."""
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, **kwargs)


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default")  # HF's, on the reference call
@pytest.mark.parametrize("lengths, new", [
    ({"max_new_tokens": 3}, 3),
    ({"max_length": 12 + 4}, 4),  # counts the prompt (12 tokens)
    ({}, 20),  # neither: HF's default, 20 new tokens
    ({"max_new_tokens": None}, 20),
    ({"max_new_tokens": 3, "max_length": 30}, 3),  # max_new_tokens wins
    ({"max_new_tokens": 3, "max_length": 5}, 3),
], ids=["max_new_tokens", "max_length", "default", "max_new_tokens_none", "both", "both_max_length_short"])
@pytest.mark.compat
def test_length_arguments_equal_hf_generate(sdpa_model, gen_ig, prompt, lengths, new):
    out = gen_ig.generate(prompt, **lengths)
    reference = hf_sequences(sdpa_model, prompt, **lengths)
    assert out.sequences.shape == (1, 12 + new)
    assert torch.equal(out.sequences, reference)
    assert len(out.steps) == new + 1 and len(out.scores) == new


def test_model_generation_config_max_length_applies_as_in_hf(sdpa_model, gen_ig, prompt):
    config = sdpa_model.generation_config
    assert config.max_length is None
    config.max_length = 15  # a checkpoint's generation_config.json may set it: a total, prompt included
    try:
        out = gen_ig.generate(prompt)
        reference = hf_sequences(sdpa_model, prompt)
    finally:
        config.max_length = None
    assert out.sequences.shape == (1, 15) and torch.equal(out.sequences, reference)


@pytest.mark.parametrize("minimum", [{"min_new_tokens": 5}, {"min_length": 12 + 5}])
@pytest.mark.compat
def test_min_lengths_keep_eos_out_as_in_hf(sdpa_model, gen_ig, prompt, generated, minimum):
    eos = int(generated.sequences[0, 13])  # the greedy 2nd new token: generation would stop at once
    early = gen_ig.generate(prompt, max_new_tokens=NEW, eos_token_id=eos)
    assert early.sequences.shape[1] == 13  # without a minimum, eos (the greedy token here) ends it at once
    out = gen_ig.generate(prompt, max_new_tokens=NEW, eos_token_id=eos, **minimum)
    reference = hf_sequences(sdpa_model, prompt, max_new_tokens=NEW, eos_token_id=eos, **minimum)
    assert torch.equal(out.sequences, reference)
    assert eos not in out.sequences[0, 12:17].tolist()  # the first 5 new tokens are not eos
    assert out.sequences.shape[1] >= 12 + 5


def test_min_length_beyond_max_length_warns_as_hf(gen_ig, prompt):
    with pytest.warns(UserWarning, match="min_length / min_new_tokens"):
        out = gen_ig.generate(prompt, max_new_tokens=2, min_new_tokens=5)
    assert out.sequences.shape == (1, 14)


def _rejected(ig, prompt, error, names, **kwargs):
    """``ig.generate(prompt, **kwargs)`` raises ``error`` naming every one of ``names``, before any
    work: no decoder is built for the (new) value set asked for."""
    before = len(ig.__dict__.get("_decoders", {}))
    with pytest.raises(error) as raised:
        ig.generate(prompt, values=["layers.2.layer_output"], **kwargs)
    for name in names:
        assert name in str(raised.value)
    assert len(ig.__dict__.get("_decoders", {})) == before
    return str(raised.value)


def test_max_new_tokens_zero_is_rejected_as_in_hf(sdpa_model, gen_ig, prompt):
    message = _rejected(gen_ig, prompt, ValueError, ["max_new_tokens", ">= 1"], max_new_tokens=0)
    assert "got 0" in message
    with pytest.raises(ValueError, match="max_new_tokens"):  # HF raises too
        hf_sequences(sdpa_model, prompt, max_new_tokens=0)


def test_negative_max_new_tokens_is_rejected(gen_ig, prompt):
    _rejected(gen_ig, prompt, ValueError, ["max_new_tokens", ">= 1", "got -1"], max_new_tokens=-1)


@pytest.mark.parametrize("value", [2.5, "3", True, torch.tensor(3)])
def test_non_int_max_new_tokens_is_rejected(gen_ig, prompt, value):
    _rejected(gen_ig, prompt, ValueError, ["max_new_tokens", "must be an int"], max_new_tokens=value)


@pytest.mark.parametrize("max_length", [12, 5])
def test_max_length_not_past_the_prompt_is_rejected_as_in_hf(sdpa_model, gen_ig, prompt, max_length):
    _rejected(gen_ig, prompt, ValueError, ["max_length", "12"], max_length=max_length)
    with pytest.raises(ValueError, match="max_length"):  # HF raises too
        hf_sequences(sdpa_model, prompt, max_length=max_length)


@pytest.mark.parametrize("max_length", [0, -3])
def test_non_positive_max_length_is_rejected(gen_ig, prompt, max_length):
    _rejected(gen_ig, prompt, ValueError, ["max_length", ">= 1", f"got {max_length}"], max_length=max_length)


def test_negative_min_new_tokens_is_rejected(gen_ig, prompt):
    _rejected(gen_ig, prompt, ValueError, ["min_new_tokens", ">= 0"], min_new_tokens=-1)


@pytest.mark.parametrize("settings, named", [
    ({"do_sample": True, "temperature": 0.0}, ["temperature=0.0", "strictly positive", "do_sample=False"]),
    ({"do_sample": True, "top_k": -5}, ["top_k=-5", "strictly positive"]),
    ({"repetition_penalty": 0.0}, ["repetition_penalty=0.0", "strictly positive"]),
    ({"do_sample": True, "top_p": -1.0}, ["top_p=-1.0"]),
    ({"do_sample": True, "seed": 2**70}, ["seed is 1180591620717411303424", "2**64 - 1"]),
], ids=["temperature", "top_k", "repetition_penalty", "top_p", "seed"])
def test_values_transformers_refuses_are_rejected_naming_the_setting(gen_ig, prompt, settings, named):
    message = _rejected(gen_ig, prompt, qgraph.InvalidArgument, named, max_new_tokens=2, **settings)
    assert "leave it out" in message


def test_non_int_min_length_is_rejected(gen_ig, prompt):
    _rejected(gen_ig, prompt, ValueError, ["min_length", "must be an int"], min_length=4.5)


def test_unknown_keyword_arguments_are_named(gen_ig, prompt):
    message = _rejected(gen_ig, prompt, TypeError, ["bogus", "max_new_tkens"], max_new_tokens=2, bogus=1,
                        max_new_tkens=3)
    assert "max_new_tokens" in message.split("it takes")[1]  # lists what generate takes


@pytest.mark.parametrize("setting", [{"num_beams": 2}, {"num_return_sequences": 3}, {"stop_strings": ["."]},
                                     {"penalty_alpha": 0.6}])
def test_unsupported_generation_settings_raise_not_implemented(gen_ig, prompt, setting):
    _rejected(gen_ig, prompt, NotImplementedError, list(setting), max_new_tokens=2, **setting)


def test_default_generation_settings_and_processor_settings_are_accepted(sdpa_model, gen_ig, prompt):
    out = gen_ig.generate(prompt, max_new_tokens=4, num_beams=1, num_return_sequences=1, output_scores=True,
                          repetition_penalty=1.3, no_repeat_ngram_size=2)
    reference = hf_sequences(sdpa_model, prompt, max_new_tokens=4, repetition_penalty=1.3, no_repeat_ngram_size=2)
    assert torch.equal(out.sequences, reference)
    assert len(set(out.sequences[0, 12:].tolist())) > 1  # the processors ran: greedy alone repeats one token


@pytest.mark.parametrize("setting, shown", [("1", True), ("0", False)])
def test_progress_bar_over_new_tokens(gen_ig, prompt, monkeypatch, capsys, setting, shown):
    from functools import partial

    import qgraph.generate
    import qgraph.progress
    monkeypatch.setenv("QGRAPH_PROGRESS", setting)
    monkeypatch.setattr(qgraph.generate, "progress", partial(qgraph.progress.progress, delay=0))  # show at once
    gen_ig.generate(prompt, max_new_tokens=3)
    err = capsys.readouterr().err
    assert ("generating" in err and "/3" in err) == shown
