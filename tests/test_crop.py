"""context_overflow="crop": past max_seq_len, each token is predicted from exactly the last
max_seq_len tokens (nanoGPT's `sample`: `idx_cond = idx[:, -block_size:]`), through
`generate` and the `Engine`, alone and batched, greedy and seeded; a longer prompt is
cropped; "error" (the default) still refuses.

One small context (16) for the whole module, so each request runs most of its steps past
it and every program here is compiled once: prompts are at most 16 tokens after cropping
(one prompt bucket), and all requests ask for the same max_new_tokens."""

import jax
import numpy as np
import pytest

from conftest import assert_lively
from gpt_jax import forward
from inference import Engine, SamplingParams, engine as engine_module, generate, naive_generate
from inference import warmup
from inference.batching import decode_rows
from inference.scheduler import Sequence

C = 16  # the module's max_seq_len
NEW = 24  # max_new_tokens: every request crosses the context
LENGTHS = (9, 12, 16, 40)  # two start inside the context, one fills it, one is cropped


@pytest.fixture(scope="module")
def small(config, params):
    """The tiny model with a 16-token context (its position table cut to 16)."""
    return config.replace(max_seq_len=C), {**params, "wpe": params["wpe"][:C]}


@pytest.fixture(scope="module")
def requests():
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 64, n).tolist() for n in LENGTHS]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW, context_overflow="crop")
    sampled = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=NEW, seed=3,
                             context_overflow="crop")
    return [(f"r{i}", p, greedy if i % 2 == 0 else sampled) for i, p in enumerate(prompts)]


def cropped_greedy(params, config, prompt, n):
    """nanoGPT's sampler, greedy: each token from `forward` over the last max_seq_len
    tokens (right-padded to max_seq_len, so one program; causal, so padding is unseen)."""
    run = jax.jit(lambda tokens: forward(params, tokens, config))
    sequence, out = list(prompt), []
    for _ in range(n):
        window = sequence[-config.max_seq_len:]
        tokens = np.zeros((1, config.max_seq_len), np.int32)
        tokens[0, : len(window)] = window
        out.append(int(np.argmax(np.asarray(run(tokens))[0, len(window) - 1])))
        sequence.append(out[-1])
    return out


@pytest.fixture(scope="module")
def references(small, requests):
    """Each request alone through `naive_generate`: `forward` on its last max_seq_len tokens
    every step, no cache."""
    config, params = small
    return {rid: naive_generate(params, config, [p], sp)[0] for rid, p, sp in requests}


def test_crop_generate_equals_forward_on_the_last_window_alone_and_batched(small, requests,
                                                                            references):
    config, params = small
    batched = generate(params, config, [p for _, p, _ in requests], [sp for *_, sp in requests])
    for (rid, prompt, sp), row in zip(requests, batched):
        ref = references[rid]
        assert_lively(ref.tokens)
        if sp.greedy:  # the reference itself, against nanoGPT's loop written out
            assert ref.tokens == cropped_greedy(params, config, prompt, NEW), rid
        (alone,) = generate(params, config, [prompt], sp)
        assert row.tokens == alone.tokens == ref.tokens, rid
        assert row.finish_reason == "length" and len(row.tokens) == NEW


def test_a_prompt_longer_than_the_context_is_cropped_to_its_last_tokens(small, requests,
                                                                        references):
    config, params = small
    rid, prompt, sp = requests[3]
    assert len(prompt) > C
    (cropped,) = generate(params, config, [prompt[-C:]], sp)
    assert cropped.tokens == references[rid].tokens


def test_crop_engine_with_preemption_equals_each_request_alone(small, requests, references):
    """Two slots, requests joining at random steps, a page pool too small for both rows at
    full context (preemption: a row past the context resumes from its last max_seq_len
    tokens), and a stop token id first sampled past the context."""
    config, params = small
    ref = references["r0"]
    past = C - len(requests[0][1])  # r0's tokens from here on are predicted from a window
    eos = next(t for i, t in enumerate(ref.tokens) if i > past and t not in ref.tokens[:i])
    stopped = ("r0-eos", requests[0][1],
               SamplingParams(temperature=0.0, max_new_tokens=NEW, stop_token_ids=[eos],
                              context_overflow="crop"))
    engine = Engine(params, config, max_slots=2, num_pages=6, page_size=4,
                    max_prefill_tokens=C)
    rng, pending, finals, streamed = np.random.default_rng(0), requests + [stopped], {}, {}
    while pending or engine.has_unfinished_requests():
        while pending and rng.random() < 0.3:
            engine.add_request(*pending.pop(0))
        for out in engine.step():
            streamed[out.request_id] = streamed.get(out.request_id, []) + out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    assert engine.stats()["preemptions"] > 0
    for rid, _, _ in requests:
        assert finals[rid].token_ids == streamed[rid] == references[rid].tokens, rid
    assert finals["r0-eos"].token_ids == ref.tokens[: ref.tokens.index(eos) + 1]
    assert finals["r0-eos"].finish_reason == "eos"
    assert engine.stats()["free_pages"] == engine.stats()["total_pages"]


def test_error_refuses_what_outgrows_the_context_with_the_exact_message(small):
    config, params = small
    for sp in (SamplingParams(max_new_tokens=7), SamplingParams(max_new_tokens=7,
                                                                context_overflow="error")):
        hint = (r"; allowed: a sum of at most 16 \(or context_overflow=\"crop\" to predict "
                r"each token from the last max_seq_len\)$")  # says how to go past the context
        with pytest.raises(ValueError, match=r"^prompt 0: prompt length 10 \+ max_new_tokens 7 "
                                             r"= 17 exceeds the model's max_seq_len 16" + hint):
            generate(params, config, [list(range(10))], sp)
        with pytest.raises(ValueError, match=r"^request 'a': prompt length 12 \+ max_new_tokens "
                                             r"7 = 19 exceeds the model's max_seq_len 16" + hint):
            Engine(params, config, max_slots=1).add_request("a", list(range(12)), sp)
        # a prompt that alone fills the context is named as such (max_new_tokens aside)
        with pytest.raises(ValueError, match=r"^request 'a': prompt length 20 leaves no room for "
                                             r"a new token in the model's max_seq_len 16; "
                                             r"allowed: prompt length \+ max_new_tokens 7 at "
                                             r"most 16 \(or context_overflow"):
            Engine(params, config, max_slots=1).add_request("a", list(range(20)), sp)
    # under crop the page budget is max_seq_len tokens: 4 pages of 4 take any length
    engine = Engine(params, config, max_slots=1, num_pages=4, page_size=4)
    engine.add_request("long", list(range(40)), SamplingParams(max_new_tokens=500,
                                                                context_overflow="crop"))
    assert engine.stats()["waiting"] == 1


def test_warmup_with_crop_covers_every_window_count(small, monkeypatch):
    """The decode programs `warmup(crop=True)` compiles (rows, window rows) are all those a
    step can ask for: any running slots, any of them crop rows near the context. (Recorded
    with stand-ins for the compiled programs: nothing is compiled here.)"""
    config, params = small
    engine = Engine(params, config, max_slots=12)
    warmed = set()

    def decode(params, config, state, table, live, rows, stops, slots, *, n_rows, pad_id):
        warmed.add((n_rows, slots.shape[0]))
        return state

    monkeypatch.setattr(warmup, "engine_prefill", lambda *args, **kwargs: args[2])
    monkeypatch.setattr(warmup, "engine_mixed", lambda *args, **kwargs: args[2])
    monkeypatch.setattr(warmup, "engine_decode", decode)
    monkeypatch.setattr(engine_module, "compile_counts", dict)
    engine.warmup(crop=True)
    crop = SamplingParams(max_new_tokens=50, context_overflow="crop")
    asked = set()
    for n in range(1, 13):  # slots 0..n-1 running, the first k of them crop rows past C
        n_rows = decode_rows(n, 12)
        for k in range(n + 1):
            running = [Sequence("r", 0, [1] * (C if i < k else 2), crop, 0, 0, 0, slot=i)
                       for i in range(n)]
            asked.add((n_rows, engine._window_slots(running, n_rows).shape[0]))
    assert asked == warmed
