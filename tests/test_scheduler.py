"""The scheduler's policy, without a model and without JAX: admission (first come first
served, while slots and pages last), chunked-prefill planning, prefill and decode taking
turns, preemption (the most recently admitted first), prefix reuse (a page's key covers
every token before it) and the page pool's eviction order (least recently used first)."""

import dataclasses
import subprocess
import sys

from inference.pages import PagePool, page_hashes
from inference.buckets import mixed_budget
from inference.scheduler import Scheduler, SchedulerPlan, Sequence, SequenceResult, Status

PAGE = 16


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The fields of `SamplingParams` the scheduler reads, and only those."""

    max_new_tokens: int = 4
    n: int = 1
    speculative: str | None = None
    num_speculative_tokens: int = 4


def scheduler(*, max_slots=8, num_pages=64, max_seq_len=256, max_prefill_tokens=128,
              prefill_chunk_tokens=128, prefix_caching=False, decode_chunk=8) -> Scheduler:
    return Scheduler(max_slots=max_slots, num_pages=num_pages, page_size=PAGE,
                     max_seq_len=max_seq_len, max_prefill_tokens=max_prefill_tokens,
                     prefill_chunk_tokens=prefill_chunk_tokens, prefix_caching=prefix_caching,
                     decode_chunk=decode_chunk)


def sequence(request_id, prompt, *, max_new_tokens=4, arrival=0, index=0, n=1) -> Sequence:
    return Sequence(request_id, index, list(prompt), Sampling(max_new_tokens, n), 0, 0, arrival)


def run_prefill(s: Scheduler) -> None:
    """Admit and prefill while prompts fit (decoding nothing)."""
    while s.admit() or (work := s.prefill_work()):
        s.prefilled(work)


def test_the_scheduler_imports_no_jax():
    code = ("import sys, inference.scheduler, inference.pages; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_admission_is_first_come_first_served_while_slots_and_pages_last():
    s = scheduler(max_slots=2, num_pages=5)
    for i, length in enumerate([40, 20, 20, 8]):  # pages: 3, 2, 2, 1
        s.add(sequence(str(i), range(length), arrival=i))
    s.admit()
    assert [q.request_id for q in s.active] == ["0", "1"]  # two slots
    assert [q.slot for q in s.active] == [0, 1] and s.pool.num_free() == 0
    assert [q.request_id for q in s.waiting] == ["2", "3"]
    s.finish(s.active[0], "length")  # frees slot 0 and 3 pages
    s.admit()
    assert [q.request_id for q in s.active] == ["1", "2"] and s.active[1].slot == 0
    # "3" would fit the free pages, but no slot is free
    assert [q.request_id for q in s.waiting] == ["3"]


def test_a_request_that_does_not_fit_the_free_pages_blocks_the_queue():
    """First come first served: a later, smaller request does not overtake the head."""
    s = scheduler(num_pages=4)
    s.add(sequence("a", range(40)))  # 3 pages
    s.add(sequence("b", range(40)))  # 3 more: only 1 free
    s.add(sequence("c", range(8)))  # 1 page: would fit, but "b" is first
    s.admit()
    assert [q.request_id for q in s.active] == ["a"]
    assert [q.request_id for q in s.waiting] == ["b", "c"]


def test_a_prefill_call_fills_its_budget_with_several_prompts_not_padding():
    """Prompts of 72 and 100 tokens, a 128-token budget: one prompt padded to 128 would put
    72 or 100 tokens through a call; two rows of 64 put 128 through, then 8 + 36 (rows of
    64, not one row of 128 holding 8). A lone prompt still goes in one row of its bucket; a
    long one in chunks of the budget (or of prefill_chunk_tokens); many short ones in rows of
    16."""
    def calls(lengths, chunk=128):
        s = scheduler(num_pages=64, max_seq_len=512, prefill_chunk_tokens=chunk)
        for i, n in enumerate(lengths):
            s.add(sequence(str(i), list(range(n)), max_new_tokens=4, arrival=i))
        s.admit()
        shapes = []
        while work := s.prefill_work():
            shapes.append([(w.seq.request_id, w.start, w.n) for w in work])
            s.prefilled(work)
        return shapes

    assert calls([72, 100]) == [[("0", 0, 64), ("1", 0, 64)], [("0", 64, 8), ("1", 64, 36)]]
    assert calls([100]) == [[("0", 0, 100)]]
    assert calls([300]) == [[("0", 0, 128)], [("0", 128, 128)], [("0", 256, 44)]]
    assert calls([20] * 6) == [[(str(i), 0, 16) for i in range(6)],
                               [(str(i), 16, 4) for i in range(6)]]
    # at most 64 tokens of one prompt per call: the long one goes in chunks of 64
    assert calls([300], chunk=64) == [[("0", lo, 64)] for lo in range(0, 256, 64)] + \
        [[("0", 256, 44)]]
    assert calls([72, 100], chunk=64) == calls([72, 100])


def test_prefill_goes_in_chunks_and_takes_turns_with_decode():
    s = scheduler(max_prefill_tokens=64, prefill_chunk_tokens=32)
    s.add(sequence("a", range(20), max_new_tokens=100))
    plan = s.schedule()
    assert [(w.seq.request_id, w.start, w.n, w.completes) for w in plan.prefill] == \
        [("a", 0, 20, True)]
    assert plan.sampled == [plan.prefill[0].seq] and plan.runs
    s.update(plan, [SequenceResult(plan.prefill[0].seq, [7], [], [])])
    assert s.active[0].status == Status.RUNNING and s.active[0].output == [7]
    s.add(sequence("b", range(100), arrival=1))  # 100 tokens: chunks of 32
    kinds = []
    for _ in range(8):
        plan = s.schedule()
        kinds.append([(w.seq.request_id, w.start, w.n) for w in plan.prefill] or
                     [q.request_id for q in plan.decode])
        s.update(plan, [SequenceResult(q, [1] * 8, [], []) for q in plan.decode])
    # after a prefill call that completes no prompt, a decode chunk for the running one,
    # turn about; the call that completes "b" (its first token) runs at once
    assert kinds == [["a"], [("b", 0, 32)], ["a"], [("b", 32, 32)], ["a"], [("b", 64, 32)],
                     [("b", 96, 4)], ["a", "b"]]
    assert not s.schedule().prefill  # nothing left to prefill: "a" and "b" decode
    assert len(s.running()) == 2


def test_a_burst_of_short_prompts_is_prefilled_first_until_the_slots_are_full():
    """Prefill calls that complete prompts run back to back while sequences run (vLLM v0's
    prefill-first order), so a burst of arrivals gets its first tokens before the next
    decode chunk; the slots bound the run: prompts beyond them wait for a finished one."""
    s = scheduler(max_slots=4, max_prefill_tokens=32, prefill_chunk_tokens=32)
    s.add(sequence("a", range(16), max_new_tokens=100))
    plan = s.schedule()
    s.update(plan, [SequenceResult(plan.prefill[0].seq, [7], [], [])])
    for i, name in enumerate("bcdef"):
        s.add(sequence(name, range(16), arrival=i + 1, max_new_tokens=100))
    kinds = []
    for _ in range(3):
        plan = s.schedule()
        kinds.append([w.seq.request_id for w in plan.prefill] or
                     [q.request_id for q in plan.decode])
        s.update(plan, [SequenceResult(q, [1], [], []) for q in plan.sampled])
    assert kinds == [["b", "c"], ["d"], ["a", "b", "c", "d"]]  # "e", "f": no slot yet
    assert [q.request_id for q in s.waiting] == ["e", "f"]
    plan = s.schedule()  # "a" finishes in this chunk: "e" takes its slot, prefilled at once
    s.update(plan, [SequenceResult(q, [1], [], [], "length" if q.request_id == "a" else None, 2)
                    for q in plan.decode])
    assert [w.seq.request_id for w in s.schedule().prefill] == ["e"]


def test_mixed_steps_decode_every_running_sequence_while_a_prompt_goes_in():
    """With mixed steps, each call that prefills a chunk also decodes every running
    sequence; the prompt budget is a share of the call's decode tokens per sequence waiting
    for its first token (`mixed_budget`), the whole budget when none decodes; a running
    sequence that cannot (speculative) makes prefill and decode chunks take turns again."""
    s = scheduler(max_prefill_tokens=40, prefill_chunk_tokens=32, decode_chunk=64,
                  num_pages=256)
    s.add(sequence("a", range(20), max_new_tokens=100))
    plan = s.schedule(mixed=True)  # nothing runs yet: a prefill-only mixed step
    assert plan.mixed and not plan.decode and [w.n for w in plan.prefill] == [20]
    s.update(plan, [SequenceResult(plan.prefill[0].seq, [7], [], [])])
    s.add(sequence("b", range(40), arrival=1, max_new_tokens=100))
    s.add(sequence("c", range(30), arrival=2))
    steps = []
    for _ in range(2):
        plan = s.schedule(mixed=True)
        assert plan.mixed
        steps.append(([q.request_id for q in plan.decode],
                      [(w.seq.request_id, w.start, w.n) for w in plan.prefill]))
        s.update(plan, [SequenceResult(q, [1], [], []) for q in plan.sampled])
    # one decoding: a share of 16 (0.25 x 64), and "c"'s 30 tokens queued behind "b" (two
    # blocks, 32): 48, at most 40; "b" takes 32, "c" 8; then "b"'s last 8 (one block) and
    # "c"'s last 22
    assert steps == [(["a"], [("b", 0, 32), ("c", 0, 8)]),
                     (["a"], [("b", 32, 8), ("c", 8, 22)])]
    plan = s.schedule(mixed=True)  # nothing to prefill: a decode chunk
    assert not plan.mixed and [q.request_id for q in plan.decode] == ["a", "b", "c"]
    assert s.mixed_shapes() == [16, 32, 64]  # the bucket of 40 and the two below
    assert (s.mixed_rows(0), s.mixed_rows(4), s.mixed_rows(5)) == (4, 4, 8)
    s.add(sequence("d", range(50), arrival=3))
    s.running()[0].sampling = Sampling(100, speculative="ngram")
    assert [bool(s.schedule(mixed=True).decode) for _ in range(4)] == [False, True] * 2


def test_mixed_budget_grows_with_the_prompt_tokens_queued():
    """The prompt budget of a mixed chunk: a quarter of its decode tokens in whole 16-token
    blocks (one at least), plus the prompt tokens queued behind the prompt going in, in
    whole blocks, at most max_prefill_tokens; all of max_prefill_tokens with nothing
    decoding."""
    cases = {(16, 0): 32, (16, 10): 48, (16, 72): 112, (16, 96): 128, (16, 500): 128,
             (8, 0): 16, (8, 16): 32, (8, 17): 48, (6, 0): 16, (4, 1): 32, (1, 0): 16,
             (32, 0): 64, (64, 0): 128, (0, 0): 128, (0, 300): 128}
    got = {k: mixed_budget(*k, decode_chunk=8, max_prefill_tokens=128) for k in cases}
    assert got == cases
    assert mixed_budget(16, 72, decode_chunk=8, max_prefill_tokens=64) == 64
    assert mixed_budget(16, 0, decode_chunk=8, max_prefill_tokens=8) == 8  # below one block
    assert mixed_budget(2, 5, decode_chunk=64, max_prefill_tokens=512) == 48
    for bad in [(-1, 0, 8, 128), (1, -1, 8, 128), (1, 1, 0, 128), (1, 1, 8, 0)]:
        try:
            mixed_budget(*bad)
        except ValueError as e:
            assert str(list(bad))[1:-1] in str(e)
        else:
            raise AssertionError(f"no error for {bad}")


def test_a_lone_long_prompt_goes_in_at_the_share_and_a_queue_behind_it_raises_the_budget():
    """Mixed steps beside 4 decoding sequences (chunk 8: a share of 8, one 16-token block):
    a long prompt alone goes in 16 tokens a call; a request queued for a slot (its 40
    tokens, 48 in blocks) raises the budget to 64, and the long prompt takes its 32-token
    chunk limit; the queue gone, 16 again."""
    s = scheduler(max_slots=5, num_pages=256, max_prefill_tokens=128, prefill_chunk_tokens=32)
    for i in range(4):
        s.add(sequence(str(i), range(8), arrival=i, max_new_tokens=200))
    run_prefill(s)
    s.add(sequence("long", range(200), arrival=4))
    chunks = []
    for step in range(4):
        if step == 1:
            s.add(sequence("queued", range(40), arrival=5))  # no slot: it waits
        if step == 3:
            s.abort("queued")
        plan = s.schedule(mixed=True)
        assert plan.mixed and len(plan.decode) == 4
        chunks.append([(w.seq.request_id, w.n) for w in plan.prefill])
        s.update(plan, [SequenceResult(q, [1], [], []) for q in plan.sampled])
    assert chunks == [[("long", 16)], [("long", 32)], [("long", 32)], [("long", 16)]]


def test_a_short_prompt_goes_in_whole_beside_decoding_sequences():
    """Mixed steps beside 4 to 8 decoding sequences (chunk 8: a share of 16), 32-token
    chunks, a 64-token cap: a lone 30-token prompt goes in whole in one call (not 16 + 14);
    a lone 40-token one is long: 16 a call. A long one then two short ones (30, 20)
    arriving together: the queue raises the budget to the cap, the long one takes its
    32-token chunk and the first short one the 32 left, whole; the second, over the cap,
    goes in whole next, beside the long one's last 8."""
    s = scheduler(max_slots=12, num_pages=256, max_prefill_tokens=64, prefill_chunk_tokens=32)
    for i in range(4):
        s.add(sequence(str(i), range(8), arrival=i, max_new_tokens=200))
    run_prefill(s)

    def chunks(calls):
        got = []
        for _ in range(calls):
            plan = s.schedule(mixed=True)
            assert plan.mixed and len(plan.decode) >= 4
            got.append([(w.seq.request_id, w.start, w.n) for w in plan.prefill])
            s.update(plan, [SequenceResult(q, [1], [], []) for q in plan.sampled])
        return got

    s.add(sequence("short", range(30), arrival=4, max_new_tokens=1))
    assert chunks(1) == [[("short", 0, 30)]]
    s.add(sequence("long", range(40), arrival=5, max_new_tokens=1))
    assert chunks(3) == [[("long", 0, 16)], [("long", 16, 16)], [("long", 32, 8)]]
    for name, n in [("long2", 40), ("a", 30), ("b", 20)]:
        s.add(sequence(name, range(n), arrival=6, max_new_tokens=1))
    assert chunks(2) == [[("long2", 0, 32), ("a", 0, 30)], [("long2", 32, 8), ("b", 0, 20)]]


def test_decode_preempts_the_most_recently_admitted_sequence():
    s = scheduler(num_pages=4, decode_chunk=24)
    for i in range(3):  # 16-token prompts: a page each, all admitted
        s.add(sequence(str(i), range(100 * i, 100 * i + 16), max_new_tokens=40, arrival=i))
    run_prefill(s)
    assert [q.status for q in s.active] == [Status.RUNNING] * 3 and s.pool.num_free() == 1
    plan = s.schedule()  # each wants 2 more pages for its next 24 tokens: 6 > 1 free
    assert [q.request_id for q in plan.preempted] == ["2", "1"]  # newest first, until the rest fit
    assert [q.request_id for q in plan.decode] == ["0"]
    assert [q.request_id for q in s.waiting] == ["1", "2"]  # at the front, in admission order
    assert all(q.status == Status.WAITING and not q.pages and q.slot is None
               for q in plan.preempted)
    assert s.preemptions == 2 and len(s.active[0].pages) == 3
    # "1" would fit the page left, which "0" needs for its next chunk (40 + 24 tokens): it
    # is not admitted into it, prefilled and preempted again (the watermark); "0" decodes
    s.update(plan, [SequenceResult(plan.decode[0], [1] * 24, [], [])])
    plan = s.schedule()
    assert not plan.prefill and [q.request_id for q in plan.decode] == ["0"]
    assert [q.request_id for q in s.waiting] == ["1", "2"] and s.preemptions == 2


def test_a_preempted_sequence_keeps_its_output_and_is_recomputed_with_it():
    s = scheduler(num_pages=2, decode_chunk=8)
    s.add(sequence("a", range(16), max_new_tokens=40))
    s.add(sequence("b", range(50, 66), max_new_tokens=40, arrival=1))
    run_prefill(s)
    b = s.active[1]
    s.update(SchedulerPlan(), [SequenceResult(b, [5, 6], [], [])])
    plan = s.schedule()
    assert plan.preempted == [b] and b.output == [5, 6]
    s.finish(s.active[0], "eos")
    s.admit()
    assert b.target == list(range(50, 66)) + [5, 6] and b.prefilled == 0  # prompt and output


def test_prefix_pages_are_reused_only_for_the_same_tokens_at_the_same_place():
    """A page's key covers every token before it: the same 16 tokens as the second page of
    one prompt and the first page of another do not match."""
    s = scheduler(prefix_caching=True)
    shared, other = list(range(16)), list(range(100, 116))
    s.add(sequence("a", shared + other + [1]))
    run_prefill(s)
    a_pages = s.active[0].pages
    s.add(sequence("b", shared + other + [2], arrival=1))  # both full pages reused
    s.add(sequence("c", other + shared + [3], arrival=2))  # same pages' tokens, other places
    s.add(sequence("d", shared + [9] * 16 + [4], arrival=3))  # first page only
    s.admit()
    b, c, d = s.active[1:]
    assert b.pages[:2] == a_pages[:2] and b.prefilled == 32
    assert not set(c.pages) & set(a_pages) and c.prefilled == 0
    assert d.pages[0] == a_pages[0] and d.pages[1] != a_pages[1] and d.prefilled == 16
    assert s.prefix_cache_hits == 3
    assert page_hashes(shared + other, PAGE)[1] != page_hashes(other, PAGE)[0]


def test_a_whole_cached_prompt_still_prefills_its_last_token():
    """Planted fault that survived (issue 41; caught only by how one seeded workload fell):
    a prefix lookup keyed on the whole prompt, not all but its last token, reused every
    page of a prompt of whole pages, leaving nothing to prefill: the last token's logits,
    which give the first new token, were never computed. Its last page is prefilled again."""
    s = scheduler(prefix_caching=True)
    prompt = list(range(2 * PAGE))  # whole pages
    s.add(sequence("a", prompt))
    run_prefill(s)
    s.add(sequence("b", prompt, arrival=1))
    s.admit()
    b = s.active[1]
    assert b.pages[0] == s.active[0].pages[0] and b.pages[1] != s.active[0].pages[1]
    assert b.prefilled == PAGE and s.prefix_cache_hits == 1
    assert [(w.seq, w.start, w.n, w.completes) for w in s.prefill_work()] == \
        [(b, PAGE, PAGE, True)]


def test_without_prefix_caching_only_the_samples_of_one_request_share_pages():
    s = scheduler(prefix_caching=False)
    prompt = list(range(33))
    s.add(sequence("a", prompt, n=2))
    s.add(sequence("a", prompt, index=1, n=2))
    s.add(sequence("b", prompt, arrival=1))
    s.admit()
    assert [q.request_id for q in s.active] == ["a"]  # the second sample waits for the pages
    run_prefill(s)
    first, second, b = s.active
    assert second.pages[:2] == first.pages[:2] and s.prefix_cache_hits == 2
    assert not set(b.pages) & set(first.pages)


def test_the_least_recently_released_cached_page_is_evicted_first():
    pool = PagePool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.register(a, b"key a"), pool.register(b, b"key b")
    pool.release([a]), pool.release([b])  # both cached, unused: a is the older
    pool.release([c])  # never cached: back to the free list
    assert pool.allocate() == c  # the free list first
    assert pool.allocate() == a  # then the least recently used cached page
    assert pool.lookup([b"key a"]) == [] and pool.lookup([b"key b"]) == [b]
    pool.retain(b)  # in use again: no longer evictable
    assert pool.num_free() == 0


def test_update_finishes_and_frees_and_abort_drops_a_request():
    s = scheduler(num_pages=8)
    s.add(sequence("a", range(20), max_new_tokens=8))
    s.add(sequence("b", range(20), max_new_tokens=8, arrival=1))
    s.add(sequence("b", range(20), max_new_tokens=8, arrival=1, index=1, n=2))
    s.add(sequence("z", range(5), max_new_tokens=0, arrival=2))  # nothing to generate
    assert s.requests["z"][0].status == Status.FINISHED and len(s.waiting) == 3
    plan = s.schedule()
    a = plan.prefill[0].seq
    s.update(plan, [SequenceResult(a, [3, 4, 5], [], [], "stop", num_tokens=2)])
    assert a.output == [3, 4] and a.finish_reason == "stop" and a.status == Status.FINISHED
    assert a.slot is None and not a.pages
    assert sorted(s.finished_requests()) == ["a", "z"] and sorted(s.requests) == ["b"]
    free = s.pool.num_free()
    aborted = s.abort("b")
    assert [q.finish_reason for q in aborted] == ["abort", "abort"]
    assert not s.active and not s.waiting and s.pool.num_free() == 8 > free
    assert s.finished_requests() == [] and not s.requests
