"""The serving engine: continuous batching over one paged KV cache. Requests that join a
running batch at random steps, get preempted, share prefix pages or are prefilled in chunks
produce exactly what they produce alone; pages all come back; compiles stay bounded; bad
requests are refused before they are queued while the engine keeps serving."""

import collections
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, assert_lively
from gpt_jax import CharTokenizer, init_cache
from gpt_jax.cache import cache_bytes
from inference import Engine, SamplingParams, compile_counts, generate, prefill, warmup
from inference.batching import engine_decode, engine_prefill, prefill_shape
from inference.mixed import engine_mixed
from inference.decode import CHUNK
from inference.llm import LLM
from inference.scheduler import PrefillWork

TOKENIZER = CharTokenizer([chr(ord("0") + i) for i in range(64)])  # '0'..'o', one per id


def random_requests(config, rng, count, *, text=True):
    """`count` requests of random lengths and settings: greedy, seeded sampling with top-k,
    top-p and penalties, n = 2, EOS ids, token stop sequences and (with `text`) stop
    strings, some asking for log-probs."""
    requests = []
    for i in range(count):
        prompt = rng.integers(0, config.vocab_size, int(rng.integers(1, 50))).tolist()
        kind = i % 5
        sp = dict(max_new_tokens=int(rng.integers(1, 40)), seed=i)
        if kind == 0:
            sp |= dict(temperature=0.0, logprobs=3)
        elif kind == 1:
            sp |= dict(temperature=0.9, top_k=12, top_p=0.9, repetition_penalty=1.3,
                       frequency_penalty=0.4, presence_penalty=0.2)
        elif kind == 2:
            sp |= dict(temperature=1.0, n=2, min_p=0.05)
        elif kind == 3:
            sp |= dict(temperature=0.0, stop_token_ids=[int(rng.integers(0, 64))],
                       stop_sequences=[[int(t) for t in rng.integers(0, 64, 2)]])
        elif text:
            sp |= dict(temperature=0.7, stop=[TOKENIZER.decode(rng.integers(0, 64, 1))])
        requests.append((f"r{i}", prompt, SamplingParams(**sp)))
    return requests


def run_engine(engine, requests, rng=None):
    """Add the requests (at random steps when `rng` is given, else all first) and step until
    all finish. Returns {(request_id, sample_index): final RequestOutput}."""
    pending, finals = list(requests), {}
    while pending or engine.has_unfinished_requests():
        while pending and (rng is None or rng.random() < 0.4):
            engine.add_request(*pending.pop(0))
        for out in engine.step():
            assert (out.request_id, out.sample_index) not in finals, "output after finishing"
            if out.finished:
                finals[(out.request_id, out.sample_index)] = out
    return finals


def assert_same_as_alone(config, params, requests, finals, reference="generate"):
    """Each sample's tokens, finish reason, log-probs and (with a tokenizer) text equal the
    request run alone: with `generate` (one compiled program per request shape), or with
    `LLM.generate` (the engine, one request at a time); stop strings always go through
    `LLM.generate`, which alone handles text."""
    llm = LLM(params, config, TOKENIZER)
    for request_id, prompt, sp in requests:
        if sp.stop or reference == "llm":
            alone = llm.generate([TOKENIZER.decode(prompt)], sp, progress=False)
        else:
            alone = generate(params, config, [prompt], sp)
        for k, ref in enumerate(alone):
            out = finals[(request_id, k)]
            assert out.token_ids == ref.tokens, (request_id, k)
            assert out.finish_reason == ref.finish_reason, (request_id, k)
            assert out.seed == ref.seed
            if out.text is not None:  # `generate` returns tokens: their text, EOS not shown
                shown = ref.tokens[:-1] if ref.finish_reason == "eos" else ref.tokens
                assert out.text == getattr(ref, "text", TOKENIZER.decode(shown))
            if sp.logprobs is not None:
                assert_close(out.logprobs, ref.logprobs, 1e-4, f"{request_id} logprobs")
                assert [list(d) for d in out.top_logprobs] == [list(d) for d in ref.top_logprobs]


def test_requests_joining_at_random_steps_equal_each_request_alone(config, params):
    """40 requests of random lengths and settings join at random steps, a third behind one
    shared two-page prefix (prefix hits), in a page pool that preempts, their prompts going
    in 12-token chunks inside mixed steps (decode rows and prefill chunks in one call):
    tokens, finish reasons, log-probs and text equal the request run alone by
    `LLM.generate` (the default engine: prefill calls and decode chunks taking turns, one
    compiled set of programs for all 40; that path equals `generate` alone in
    `test_prefix_caching_shares_pages_and_changes_no_output`)."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 64, 16).tolist()
    requests = [(r, shared + p if i % 3 == 0 else p, sp)
                for i, (r, p, sp) in enumerate(random_requests(config, rng, 40))]
    engine = Engine(params, config, TOKENIZER, max_slots=8, page_size=8, num_pages=32,
                    max_prefill_tokens=24, prefill_chunk_tokens=12, mixed_steps=True)
    steps = collections.Counter()  # mixed steps by (decodes, prefills)

    def mixed_program(params, config, state, table, batch, *args, **kwargs):
        prefills = (~batch.decode & (batch.slot < engine.max_slots)).any()
        steps[bool(batch.decode.any()), bool(prefills)] += 1
        return engine_mixed(params, config, state, table, batch, *args, **kwargs)

    engine.mixed_program = mixed_program
    finals = run_engine(engine, requests, rng)
    assert len(finals) == sum(sp.n for *_, sp in requests)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert steps[True, True] > 10, steps
    assert_lively([t for out in finals.values() for t in out.token_ids], 30)
    assert {out.finish_reason for out in finals.values()} >= {"length", "eos", "stop"}
    assert_same_as_alone(config, params, requests, finals, reference="llm")
    assert stats["free_pages"] == stats["total_pages"]


def test_a_small_page_pool_preempts_and_changes_no_output(config, params):
    rng = np.random.default_rng(1)
    requests = random_requests(config, rng, 10, text=False)
    engine = Engine(params, config, max_slots=8, num_pages=24, page_size=4)
    finals = run_engine(engine, requests, rng)
    stats = engine.stats()
    assert stats["preemptions"] > 0, stats
    assert_same_as_alone(config, params, requests, finals, reference="llm")
    assert stats["free_pages"] == stats["total_pages"] == 24
    assert not engine.has_unfinished_requests()


def run_preempted(engine, prompt, sampling, at: int):
    """Run one request, preempting it once when it has `at` tokens of output (1: after its
    prefill, 1 + CHUNK: after one decode chunk). Returns its final RequestOutput."""
    engine.add_request("r", prompt, sampling)
    (seq,) = engine.scheduler.requests["r"]
    preempted, final = False, None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
        if not preempted and len(seq.output) == at and not final:
            engine.scheduler.preempt(seq)
            preempted = True
    assert preempted and engine.stats()["preemptions"] == 1
    return final


@pytest.mark.parametrize("at", [1, 1 + CHUNK])
def test_a_two_token_stop_sequence_straddling_a_preemption_stops(config, params, at):
    """Planted fault that survived (issue 41): a preempted request resumed without its
    recent-token window, so a token stop sequence whose first token came before the
    preemption and second after it was missed (the row ran to max_new_tokens). Greedy,
    preempted between the two tokens: it stops there, finish_reason "stop"."""
    def first_pair(prompt):  # the greedy tokens and the pair at `at`, when it is new there
        tokens = generate(params, config, [prompt],
                          SamplingParams(temperature=0.0, max_new_tokens=at + 1))[0].tokens
        pair = tokens[at - 1: at + 1]  # the last token before the preemption, the next
        return tokens, pair, pair not in [tokens[i:i + 2] for i in range(at - 1)]

    prompts = [[3, 14, 15, 9, 26], [2, 7, 18, 28, 18], [1, 41, 42, 13, 56], [60, 2, 5, 7, 11]]
    prompt, (tokens, pair, _) = next((p, f) for p in prompts if (f := first_pair(p))[2])
    sampling = SamplingParams(temperature=0.0, max_new_tokens=40, stop_sequences=[pair])
    out = run_preempted(Engine(params, config, max_slots=2, page_size=8), prompt, sampling, at)
    assert out.finish_reason == "stop" and out.token_ids == tokens[:at - 1]  # the pair cut


def test_penalties_count_the_output_from_before_a_preemption(config, params):
    """Planted fault that survived (issue 41; caught only by how one seeded workload fell):
    a preempted request resumed with its output counts zeroed, so the frequency, presence
    and repetition penalties forgot its tokens from before. Preempted after a decode chunk,
    it equals the request alone."""
    prompt = [3, 14, 15, 9, 26]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=3 * CHUNK, frequency_penalty=1.5,
                              presence_penalty=0.5, repetition_penalty=1.3)
    alone = generate(params, config, [prompt], sampling)[0]
    out = run_preempted(Engine(params, config, max_slots=2, page_size=8), prompt, sampling,
                        1 + CHUNK)
    assert out.token_ids == alone.tokens


def test_prefix_caching_shares_pages_and_changes_no_output(config, params):
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, 64, 3 * 8).tolist()  # 3 pages of 8
    requests = [(f"p{i}", prefix + rng.integers(0, 64, int(rng.integers(1, 9))).tolist(),
                 SamplingParams(temperature=0.0 if i % 2 else 0.8, max_new_tokens=12, seed=i))
                for i in range(6)]
    results, stats = {}, {}
    for caching in (True, False):
        engine = Engine(params, config, max_slots=4, page_size=8, prefix_caching=caching)
        # All at once: the later ones wait for the first to write the prefix pages
        results[caching] = run_engine(engine, requests)
        stats[caching] = engine.stats()
    assert stats[True]["prefix_cache_hits"] >= 5 * 3, stats[True]
    assert stats[False]["prefix_cache_hits"] == 0
    saved = stats[False]["prefilled_tokens"] - stats[True]["prefilled_tokens"]
    assert saved >= 5 * 3 * 8, stats
    assert {k: v.token_ids for k, v in results[True].items()} == \
        {k: v.token_ids for k, v in results[False].items()}
    assert_same_as_alone(config, params, requests[1:], results[True])

    # an aborted request frees its pages at once (its full prompt pages stay cached, free)
    engine = Engine(params, config, max_slots=4, page_size=8)
    engine.add_request("long", prefix + [1, 2, 3], SamplingParams(max_new_tokens=60))
    engine.step()
    assert engine.stats()["free_pages"] < engine.stats()["total_pages"]
    engine.abort("long")
    assert engine.stats()["free_pages"] == engine.stats()["total_pages"]
    assert not engine.has_unfinished_requests()


def test_chunked_prefill_equals_one_prefill(config, params):
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 64, (1, 40)), jnp.int32)
    one, _ = prefill(params, config, tokens, jnp.array([40]), init_cache(config, 1, 64, page_size=8))
    cache = init_cache(config, 1, 64, page_size=8)
    for lo, hi in ((0, 16), (16, 29), (29, 40)):  # chunks that end inside pages
        chunk = jnp.zeros((1, 16), jnp.int32).at[:, : hi - lo].set(tokens[:, lo:hi])
        logits, cache = prefill(params, config, chunk, jnp.array([hi - lo]), cache)
    assert int(cache.lengths[0]) == 40
    assert_close(logits, one, 1e-5, "chunked prefill logits")

    # the engine with a 16-token budget: a 100-token prompt over 7 steps, same tokens
    prompt = rng.integers(0, 64, 100).tolist()
    sp = SamplingParams(temperature=0.0, max_new_tokens=20)
    (alone,) = generate(params, config, [prompt], sp)
    assert_lively(alone.tokens)
    # "short" gets its first token with its prefill, then: in mixed chunks, 8 tokens in each
    # call that prefills a 16-token block of "long"; without, a chunk of 8 between each
    # 16-token chunk of "long" (prefill and decode take turns)
    for mixed, expected in ((True, [1, 8, 8, 8, 2]), (False, [1, 8, 0, 8, 0, 8, 0, 2])):
        engine = Engine(params, config, max_slots=4, max_prefill_tokens=16, mixed_steps=mixed)
        engine.add_request("short", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=27))
        engine.add_request("long", prompt, sp)
        counts, finals = [], {}
        while engine.has_unfinished_requests():
            outs = {o.request_id: o for o in engine.step()}
            counts.append(len(outs.get("short").new_token_ids) if "short" in outs else 0)
            finals |= {r: o for r, o in outs.items() if o.finished}
        assert counts[: len(expected)] == expected, (mixed, counts)
        assert finals["long"].token_ids == alone.tokens


def serve_engine(config, params, *flags):
    """The Engine `gpt-jax serve` builds with `flags` (its defaults otherwise)."""
    from inference import serve

    args = serve.parse_args(["--run-dir", "unused", *flags])
    return Engine(params, config, **serve.engine_sizes(args, config))


def test_serve_slots_share_a_pool_of_sixteen_contexts(config, params):
    """`serve`'s 64 slots share pages for 16 sequences of the model's context (every slot
    holding its context would be 4x the memory); fewer slots, pages for as many contexts;
    --kv-cache-bytes sizes the pool itself."""
    per_context = -(-config.max_seq_len // 16)  # pages of 16 tokens
    assert serve_engine(config, params).num_pages == 16 * per_context
    assert serve_engine(config, params, "--max-slots", "4").num_pages == 4 * per_context
    one = cache_bytes(config, 1, 16)
    assert serve_engine(config, params, "--kv-cache-bytes", str(3 * one)).num_pages == 3


def test_a_prefill_call_takes_the_smallest_listed_shape_that_holds_it(config, params):
    """The defaults' prefill shapes (16 slots, 128-token budget, 64-token chunks): a call
    of 2 or 3 rows pads to a listed row count, never to an unlisted power of two."""
    shapes = [(8, 16), (1, 32), (4, 32), (1, 64), (2, 64)]
    assert Engine(params, config).scheduler.prefill_shapes() == shapes
    chunks = lambda *ns: [PrefillWork(None, 0, n) for n in ns]  # noqa: E731
    assert prefill_shape(shapes, chunks(10)) == (1, 32)  # no lone row at 16 (12 programs)
    assert prefill_shape(shapes, chunks(20)) == (1, 32)
    assert prefill_shape(shapes, chunks(10, 12)) == (2, 64)  # 128 tokens, the fewest rows
    assert prefill_shape(shapes, chunks(10, 12, 16)) == (4, 32)
    assert prefill_shape(shapes, chunks(*[16] * 5)) == (8, 16)
    assert prefill_shape(shapes, chunks(64, 33)) == (2, 64)
    with pytest.raises(ValueError, match="no shape"):
        prefill_shape(shapes, chunks(64, 64, 64))


@pytest.mark.parametrize("mixed", [False, True])
def test_a_random_workload_runs_only_the_programs_warmup_lists(config, params, mixed):
    """Compiles stay bounded: warmup lists at most 12 programs and compiles them, then 200
    random requests (chunked prompts, in mixed steps or in prefill calls of a few rows
    padded to a listed shape, n = 2, stops, log-probs) run only listed programs and compile
    nothing more."""
    rng = np.random.default_rng(4)
    requests = random_requests(config, rng, 200, text=False)
    engine = Engine(params, config, max_slots=8, max_prefill_tokens=64, mixed_steps=mixed)
    listed = set(warmup.programs(engine))
    assert len(listed) <= 12, sorted(listed)
    for mixed_steps in (False, True):  # the defaults: 6 + 5 prefill, 2 x 3 + 6 mixed
        assert len(warmup.programs(Engine(params, config, mixed_steps=mixed_steps))) <= 12
    served = serve_engine(config, params)  # serve's defaults: 64 slots, 7 decode + 5 prefill
    assert (served.max_slots, served.scheduler.max_prefill_tokens) == (64, 256)
    assert len(warmup.programs(served)) <= 12
    ran = set()

    def prefill_program(params, config, state, table, batch, *args, **kwargs):
        ran.add(warmup.Program("prefill", *batch.tokens.shape))
        return engine_prefill(params, config, state, table, batch, *args, **kwargs)

    def decode_program(params, config, state, table, live, rows, stops, window, **kwargs):
        ran.add(warmup.Program("decode", kwargs["n_rows"], window=window.shape[0]))
        return engine_decode(params, config, state, table, live, rows, stops, window, **kwargs)

    def mixed_program(params, config, state, table, batch, *args, **kwargs):
        rows = kwargs["n_rows"]
        ran.add(warmup.Program("mixed", rows, batch.tokens.shape[0] - rows))
        return engine_mixed(params, config, state, table, batch, *args, **kwargs)

    engine.prefill_program, engine.decode_program = prefill_program, decode_program
    engine.mixed_program = mixed_program
    assert engine.warmup() <= len(listed)
    assert ran == listed
    ran.clear()
    before = compile_counts()
    finals = run_engine(engine, requests, rng)
    assert compile_counts() == before
    assert len(finals) == sum(sp.n for *_, sp in requests)
    assert len(ran) >= 4 and ran <= listed, (sorted(ran), sorted(listed))


def test_after_warmup_serving_compiles_nothing(config, params, caplog):
    """Neither a new trace (compile_counts) nor any XLA compile: of a traced program (an
    argument committed to a device where warmup's was not once compiled the first prefill
    again, seconds into the first request), of the host arrays' staging (`jnp.asarray`
    compiled a program per shape and dtype for each request's sampling and stop arrays),
    or of a helper (the speculative state's restart when a sequence joins the batch)."""
    rng = np.random.default_rng(5)
    engine = Engine(params, config, max_slots=4, max_prefill_tokens=32, prefill_chunk_tokens=16)
    engine.warmup()  # prefill shapes up to the 16-token chunk, not the 32-token budget
    before = compile_counts()
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        engine.add_request("first", [1, 2, 3], SamplingParams(max_new_tokens=3))
        while engine.has_unfinished_requests():  # warmup's first program: one short prompt
            engine.step()
        run_engine(engine, random_requests(config, rng, 24, text=False), rng)
    assert compile_counts() == before
    compiled = [r.getMessage()[:40] for r in caplog.records
                if r.getMessage().startswith("Compiling ")]
    assert compiled == []
    with pytest.raises(RuntimeError, match="before adding requests"):
        engine.add_request("x", [1], SamplingParams(max_new_tokens=30))
        engine.warmup()


def test_bad_requests_are_refused_and_the_engine_keeps_serving(config, params):
    engine = Engine(params, config, max_slots=2, num_pages=6, page_size=8)
    engine.add_request("ok", [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=10))
    with pytest.raises(ValueError, match=r"request_id 'ok' is already in the engine"):
        engine.add_request("ok", [4], SamplingParams())
    with pytest.raises(ValueError, match=r"request 'empty': the prompt is \[\]; a prompt is a "
                                         r"non-empty list of token ids"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match=r"request 'oov': token id 64 is outside \[0, 64\)"):
        engine.add_request("oov", [1, 64], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt length 40 \+ max_new_tokens 20 needs 8 pages "
                                         r"of 8 tokens, but the page pool has 6"):
        engine.add_request("big", [1] * 40, SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match=r"stop strings need a tokenizer"):
        engine.add_request("stop", [1], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match=r"SamplingParams.top_p=1.5 is out of range"):
        engine.add_request("bad", [1], SamplingParams(top_p=1.5))
    with pytest.raises(KeyError, match="nope"):
        engine.abort("nope")
    assert engine.stats()["waiting"] == 1
    finals = run_engine(engine, [])
    (ref,) = generate(params, config, [[1, 2, 3]], SamplingParams(temperature=0.0,
                                                                   max_new_tokens=10))
    assert finals[("ok", 0)].token_ids == ref.tokens
    engine.abort("ok")  # finished: nothing happens
    for bad in ({"max_slots": 0}, {"max_slots": True}, {"num_pages": 2.5},
                {"kv_cache_bytes": 0}, {"page_size": -1}):
        (name, value), = bad.items()
        with pytest.raises(ValueError, match=rf"Engine {name} must be an int >= 1, got {value}"):
            Engine(params, config, **bad)
    with pytest.raises(ValueError, match=r"kv_cache_bytes=100 holds no page; one page of 16 "
                                         r"tokens takes 8192 bytes"):
        Engine(params, config, kv_cache_bytes=100)
    with pytest.raises(ValueError, match=r"Engine page_size must be at most the model's "
                                         rf"max_seq_len {config.max_seq_len} \(or 16\), got 1000000"):
        Engine(params, config, page_size=10**6)  # would allocate 16 x 10**6 slots
    for dtype in ("float16", "nonsense"):
        with pytest.raises(ValueError, match=rf"cache_dtype must be float32 or bfloat16, got "
                                             rf"'{dtype}'"):
            Engine(params, config, cache_dtype=dtype)
