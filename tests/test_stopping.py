"""Stop conditions: EOS bookkeeping (case G15), token stop sequences in the compiled loop,
min_tokens, and the text helpers behind stop strings."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_lively
from gpt_jax import forward
from inference import engine, generation, steps, stopping
from inference.sampling_params import SamplingParams

EOS, PAD = 2, 1
FORCED_AT = 5  # cache length at which row 0 (prompt of 3) produces its third token


def forced_eos_model(params, config, capacity, cache_dtype):
    """The cached model with a logit bias: EOS (id 2) is certain for the token produced at
    cache length 5 (the third token of a 3-token prompt) and impossible everywhere else."""
    prefill_fn, step_fn = steps.cached_model(params, config, capacity, cache_dtype)

    def bias(logits_BV, cache):
        forced_B = cache.lengths == FORCED_AT
        return logits_BV.at[:, EOS].add(jnp.where(forced_B, 1e4, -1e4)), cache

    return (lambda *a: bias(*prefill_fn(*a))), (lambda *a: bias(*step_fn(*a)))


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15]]  # row 1's lengths never equal FORCED_AT


def run_state(params, config, sampling):
    prompts, sampling = generation.validate(config, PROMPTS, sampling)
    batch = generation.pack(config, prompts, sampling, pad_id=PAD)
    state = generation.generate_program(
        params, config, jnp.asarray(batch.prompt_tokens), jnp.asarray(batch.prompt_lengths),
        jnp.asarray(batch.source_B), batch.rows, batch.stops, capacity=batch.capacity,
        n_steps=batch.n_steps, n_top=batch.n_top, model_fns=forced_eos_model,
        cache_dtype=jnp.float32, pad_id=PAD, forked=batch.forked)
    return batch, state


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[EOS], logprobs=2),
    SamplingParams(temperature=1.0, top_k=30, max_new_tokens=6, stop_token_ids=[40, EOS, 41],
                   repetition_penalty=1.3, seed=4, logprobs=2),
], ids=["greedy", "sampled-several-eos-ids"])
def test_g15_eos_is_written_counted_and_ends_only_its_row(config, params, sampling):
    batch, state = run_state(params, config, sampling)
    out = generation.unpack(batch, state)
    tokens = np.asarray(state.tokens)
    assert tokens[0, 2] == EOS and (tokens[0, 3:6] == PAD).all()
    assert out[0].tokens == tokens[0, :3].tolist() and out[0].finish_reason == "eos"
    assert int(state.num_tokens[0]) == 3
    assert int(np.asarray(state.output_counts)[0].sum()) == 3  # nothing counted after EOS
    assert int(state.model.lengths[0]) == FORCED_AT  # x1, x2 fed; EOS and later not fed
    assert (np.asarray(state.logprobs)[0, 3:] == 0).all()
    assert len(out[0].logprobs) == 3 and out[0].logprobs[2] > -1e-3  # EOS was certain
    assert len(out[1].tokens) == 6 and out[1].finish_reason == "length"
    solo = generation.run(params, config, PROMPTS[1:], sampling, model_fns=forced_eos_model)[0]
    assert solo.tokens == out[1].tokens


def test_token_stop_sequence_ends_the_row_and_is_cut(config, params):
    prompt = [3, 4, 5]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
    (ref,) = generation.generate(params, config, [prompt], greedy)
    g = ref.tokens
    assert_lively(g)
    j = next(j for j in range(3, 28) if all(g[i:i + 2] != g[j:j + 2] for i in range(j)))
    across = prompt[-2:] + g[:1]  # matches only across the prompt boundary
    assert all(g[i:i + 3] != across for i in range(j + 1))
    sequences = [g[j:j + 2], g[j - 1:j + 2], across]
    (out,) = generation.generate(params, config, [prompt], SamplingParams(
        temperature=0.0, max_new_tokens=32, stop_sequences=sequences))
    assert out.tokens == g[:j - 1]  # the longer of the two matching sequences is cut
    assert out.finish_reason == "stop"


def test_stop_arrays_are_right_aligned_and_bucketed():
    arrays = stopping.StopArrays.from_lists([5, 6], [(), (2, 3)], [((7,), (8, 9)), ()])
    assert arrays.stop_token_ids.shape == (2, 4) and arrays.stop_token_ids[1, :2].tolist() == [2, 3]
    seqs = np.asarray(arrays.stop_sequences)
    assert seqs.shape == (2, 4, 4)
    assert seqs[0, 0].tolist() == [-1, -1, -1, 7] and seqs[0, 1].tolist() == [-1, -1, 8, 9]
    assert (seqs[1] == -1).all()


def test_matched_stop_length_needs_the_whole_sequence_inside_the_output():
    seqs = jnp.asarray(stopping.StopArrays.from_lists(
        [9], [()], [((8, 9), (7, 8, 9), (4,))]).stop_sequences.repeat(4, axis=0))
    b = stopping.BEFORE_START
    recent = jnp.array([[b, b, 8, 9], [b, 7, 8, 9], [b, b, b, 9], [3, 4, 5, 9]])
    assert stopping.matched_stop_length(recent, seqs).tolist() == [2, 3, 0, 0]


@pytest.mark.parametrize("text, stops, expected", [
    ("abcdef", ("cd",), (2, 4)),
    ("abcdef", ("zz",), None),
    ("abcdef", ("bcdef", "de"), (3, 5)),  # "de" is complete first
    ("abcdef", ("cde", "bcde"), (1, 5)),  # both end at 5: the earlier start
])
def test_find_stop_picks_the_first_completed_stop_string(text, stops, expected):
    assert stopping.find_stop(text, stops) == expected


@pytest.mark.parametrize("text, stops, after, expected", [
    ("abcdef", ("cd",), 3, (2, 4)),  # starts inside the first `after` characters, ends past
    ("abcdef", ("cd",), 4, None),  # ends at `after`: does not count
    ("abcdcd", ("cd",), 4, (4, 6)),  # the first occurrence that ends past it
    ("abcdef", ("bcdef", "de"), 5, (1, 6)),
])
def test_find_stop_after_skips_occurrences_ending_inside_min_tokens(text, stops, after, expected):
    assert stopping.find_stop(text, stops, after) == expected


@pytest.mark.parametrize("text, stops, expected", [
    ("hello wor", ("world",), 3), ("hello", ("world",), 0), ("abcab", ("abx", "cabz"), 3),
    ("w", ("world",), 1), ("", ("world",), 0),
])
def test_held_back_is_the_longest_tail_that_may_start_a_stop_string(text, stops, expected):
    assert stopping.held_back(text, stops) == expected


CANDIDATES = [[3, 4, 5], [8, 1, 9], [20, 21, 22], [40, 2, 7], [11, 50, 33]]  # the first that fits


@pytest.mark.parametrize("run", ["generate", "engine"])
def test_eos_on_the_last_allowed_step_reports_eos_not_length(config, params, run):
    """Fault: checking the length limit before EOS. With max_new_tokens=3 and the third
    greedy token as the EOS id, the row ends on its last allowed step *because* of the EOS."""
    outputs = generation.generate(params, config, CANDIDATES,
                              SamplingParams(temperature=0.0, max_new_tokens=3))
    prompt, ref = next((p, o) for p, o in zip(CANDIDATES, outputs)
                       if o.tokens[2] not in o.tokens[:2])
    sampling = SamplingParams(temperature=0.0, max_new_tokens=3, stop_token_ids=[ref.tokens[2]])
    out = _run_one(params, config, prompt, sampling, run)
    assert out == (ref.tokens, "eos")


@pytest.mark.parametrize("run", ["generate", "engine"])
def test_stop_sequence_completed_on_the_last_allowed_step_reports_stop_and_cuts(
        config, params, run):
    outputs = generation.generate(params, config, CANDIDATES,
                              SamplingParams(temperature=0.0, max_new_tokens=4))
    prompt, g = next((p, o.tokens) for p, o in zip(CANDIDATES, outputs)
                     if o.tokens[2:4] not in (o.tokens[0:2], o.tokens[1:3]))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4, stop_sequences=[g[2:4]])
    assert _run_one(params, config, prompt, sampling, run) == (g[:2], "stop")


def _run_one(params, config, prompt, sampling, run):
    """`(tokens, finish_reason)` of one request through `generate` or the serving Engine."""
    if run == "generate":
        (out,) = generation.generate(params, config, [prompt], sampling)
        return out.tokens, out.finish_reason
    eng = engine.Engine(params, config, max_slots=2)
    eng.add_request("r", prompt, sampling)
    final = None
    while eng.has_unfinished_requests():
        final = next((o for o in eng.step() if o.finished), final)
    return final.token_ids, final.finish_reason


# ------------------------------------------------------------------------------ min_tokens


def test_ban_early_eos_bans_only_a_rows_eos_ids_and_only_while_early():
    stops = stopping.StopArrays.from_lists([9, 9, 9], [(2,), (2, 3), ()], [(), (), ()],
                                           min_tokens=[3, 3, 3])
    assert stops.stop_token_ids.shape == (3, 4)  # UNUSED padding, which must ban nothing
    out = np.asarray(stopping.ban_early_eos(jnp.zeros((3, 6)), jnp.array([2, 3, 0]), stops))
    assert np.isinf(out[0, 2]) and np.isfinite(np.delete(out[0], 2)).all()  # step 2 < 3
    assert (out[1:] == 0).all()  # row 1 has reached its min_tokens; row 2 has no EOS ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("min_tokens, reason", [(2, "eos"), (3, "length")])
def test_min_tokens_bans_an_eos_up_to_its_boundary(config, params, temperature, min_tokens,
                                                   reason):
    """forced_eos_model makes EOS certain for row 0's token at index 2: min_tokens 2 allows it
    there (2 tokens before it), min_tokens 3 bans it, and the row runs to its length."""
    sampling = SamplingParams(temperature=temperature, seed=1, max_new_tokens=6,
                              stop_token_ids=[EOS], min_tokens=min_tokens, logprobs=1)
    batch, state = run_state(params, config, sampling)
    out = generation.unpack(batch, state)
    assert out[0].finish_reason == reason
    if reason == "eos":
        assert len(out[0].tokens) == 3 and out[0].tokens[2] == EOS
    else:
        assert len(out[0].tokens) == 6 and EOS not in out[0].tokens
        assert out[0].logprobs[2] < -100  # log-probs are the model's: EOS was its choice
    assert len(out[1].tokens) == 6 and out[1].finish_reason == "length"


@functools.partial(jax.jit, static_argnames="config")
def _last_logits(params, tokens_T, length, config):
    return forward(params, tokens_T[None], config)[0, length - 1]


def greedy_with_min_tokens(params, config, prompt, eos, min_tokens, max_new_tokens):
    """The rule written out, by full recomputation: greedy, the EOS id excluded while fewer
    than min_tokens tokens have been generated, the row ending at an EOS after that."""
    tokens = []
    while len(tokens) < max_new_tokens:
        sequence = prompt + tokens
        padded = jnp.asarray(sequence + [0] * (config.max_seq_len - len(sequence)))
        logits = np.array(_last_logits(params, padded, len(sequence), config))
        if len(tokens) < min_tokens:
            logits[eos] = -np.inf
        tokens.append(int(np.argmax(logits)))
        if tokens[-1] == eos:
            return tokens, "eos"
    return tokens, "length"


@pytest.mark.parametrize("run", ["generate", "engine"])
def test_an_eos_inside_min_tokens_does_not_stop_the_row(config, params, run):
    """Greedy, the EOS id is the row's second token: without min_tokens the row ends there;
    with min_tokens 8 it runs on (the EOS never appears among its first 8 tokens), exactly as
    greedy decoding that skips the EOS while fewer than 8 tokens exist."""
    outputs = generation.generate(params, config, CANDIDATES,
                              SamplingParams(temperature=0.0, max_new_tokens=24))
    prompt, ref = next((p, o.tokens) for p, o in zip(CANDIDATES, outputs)
                       if o.tokens[1] != o.tokens[0])
    eos = ref[1]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=[eos],
                              min_tokens=8)
    expected = greedy_with_min_tokens(params, config, prompt, eos, 8, 24)
    assert eos not in expected[0][:8] and len(expected[0]) > 8
    assert _run_one(params, config, prompt, sampling, run) == expected
    assert _run_one(params, config, prompt, dataclasses.replace(sampling, min_tokens=0),
                    run) == (ref[:2], "eos")


@pytest.mark.parametrize("run", ["generate", "engine"])
def test_a_stop_sequence_completed_inside_min_tokens_does_not_count(config, params, run):
    """A token stop sequence seen once in the greedy output, completed by the token at index
    j + 1: min_tokens j + 1 lets it stop the row (cut), j + 2 does not (the row runs to its
    length; greedy tokens do not depend on stop sequences)."""
    outputs = generation.generate(params, config, CANDIDATES,
                              SamplingParams(temperature=0.0, max_new_tokens=24))
    for prompt, out in zip(CANDIDATES, outputs):
        g = out.tokens
        pairs = [tuple(g[i:i + 2]) for i in range(23)]
        j = next((j for j in range(3, 20) if pairs.count(pairs[j]) == 1), None)
        if j is not None:
            break
    assert j is not None, "no greedy output has a pair of tokens seen once"
    sampling = SamplingParams(temperature=0.0, max_new_tokens=24, stop_sequences=[g[j:j + 2]])
    assert _run_one(params, config, prompt, dataclasses.replace(sampling, min_tokens=j + 1),
                    run) == (g[:j], "stop")
    assert _run_one(params, config, prompt, dataclasses.replace(sampling, min_tokens=j + 2),
                    run) == (g, "length")
