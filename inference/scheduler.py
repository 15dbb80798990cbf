"""The host side of `inference.Engine`: sequences and their states, and the choice of what to
admit, prefill, decode or preempt each step, over the pages of `inference.pages.PagePool`
(reference counts and automatic prefix caching).

The contract is vLLM v1's: `add` and `abort` requests' sequences, `schedule()` returns a
`SchedulerPlan` (which chunks to prefill, or which sequences to decode and which were
preempted for them), the engine runs it on the device, and `update(plan, results)` advances
the sequences from what the device returned. Nothing here touches the device, and nothing
imports JAX: the policy (admission, chunked prefill, preemption, prefix reuse, eviction)
is tested without a model (tests/test_scheduler.py).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import heapq
from inference.pages import PagePool, page_hashes
from inference.buckets import MIN_PROMPT_BUCKET, bucket, bucket_up, mixed_budget
from inference.sampling_params import SamplingParams  # plain Python: no JAX here


class Status(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted with its progress kept)
    PREFILLING = "prefilling"  # holds a slot and pages; prompt chunks going in
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample of a request, as the scheduler tracks it."""

    request_id: str
    sample_index: int
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    prompt_hash: int  # `inference.sampling.prompt_hash(prompt)`, mixed into the row's keys
    arrival: int  # order of add_request, for first-come first-served
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    target: list[int] = dataclasses.field(default_factory=list)  # tokens to be in the cache
    prefilled: int = 0  # tokens of `target` in the cache
    registered: int = 0  # full pages of `target` put in the prefix cache
    admitted: int = -1  # admission order: the latest admitted is preempted first
    finish_reason: str | None = None
    shown: int = 0  # text characters already returned
    text: str = ""  # final text (set when finished with a tokenizer)

    @property
    def length(self) -> int:
        """The prompt and every output token: the tokens in the cache of a running sequence,
        up to max_seq_len (a "crop" request's cache holds at most that many)."""
        return len(self.prompt) + len(self.output)


@dataclasses.dataclass
class PrefillWork:
    """One row of a prefill call: `n` tokens of `seq.target` from position `start`."""

    seq: Sequence
    start: int
    n: int

    @property
    def completes(self) -> bool:
        return self.start + self.n == len(self.seq.target)


@dataclasses.dataclass
class SchedulerPlan:
    """What one engine step runs: one prefill call, or one chunk of decode steps, or nothing."""

    prefill: list[PrefillWork] = dataclasses.field(default_factory=list)  # the call's rows
    decode: list[Sequence] = dataclasses.field(default_factory=list)  # running, a chunk each
    # sent back to the waiting queue (pages and slot freed, output kept) to make room for
    # the decode chunk of the others; they are recomputed when admitted again
    preempted: list[Sequence] = dataclasses.field(default_factory=list)
    # one mixed step (`inference.mixed`): the prefill rows and one decode step of `decode`
    mixed: bool = False

    @property
    def runs(self) -> bool:
        """Whether the step runs a device program."""
        return bool(self.prefill or self.decode)

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences the step samples tokens for: each whose prompt the prefill call
        completes (its first token), or each decoded one."""
        return [w.seq for w in self.prefill if w.completes] + self.decode


@dataclasses.dataclass
class SequenceResult:
    """What the device returned for one sequence of a plan: its new tokens, and whether it
    finished."""

    seq: Sequence
    tokens: list[int]  # generated since the last result
    logprobs: list[float]  # theirs, when the request asked (else empty)
    top_logprobs: list[dict[int, float]]  # the most likely alternatives per token, likewise
    finish_reason: str | None = None  # "eos", "stop" or "length"; None while running
    num_tokens: int = 0  # when finished: its output tokens (a token stop sequence cut off)


class Scheduler:
    """Queues, slots and pages, and the step plan. `Engine` calls `add` and `abort` for its
    requests' sequences and, each step, `schedule()`, then `update(plan, results)` with
    what the device returned (`finish` for a sample its text stopped); `finished_requests()`
    hands over the requests that are done.

    Policy: waiting sequences are admitted first come first served while their tokens fit
    the free pages (`admit`); with prompts to prefill and sequences running, a prefill
    call (`prefill_work`) that completes prompts runs before any decode chunk (their first
    token; a burst of arrivals is prefilled first, as vLLM v0 orders it, until the slots
    are full), while one that only advances a long prompt takes turns with the decode
    chunks, so a long prompt never stalls the running sequences for more than one prefill
    call in a row; a decode chunk that the free pages cannot hold preempts the most
    recently admitted sequence until the rest fit (`reserve_decode`)."""

    def __init__(self, *, max_slots: int, num_pages: int, page_size: int, max_seq_len: int,
                 max_prefill_tokens: int, prefill_chunk_tokens: int, prefix_caching: bool,
                 decode_chunk: int):
        self.max_slots, self.page_size, self.max_seq_len = max_slots, page_size, max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefix_caching = prefix_caching
        self.decode_chunk = decode_chunk  # decode steps per decode plan
        self.pool = PagePool(num_pages)
        self.free_slots = list(range(max_slots))  # a heap: the lowest slot first
        self.requests: dict[str, list[Sequence]] = {}  # unfinished requests' samples
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.active: list[Sequence] = []  # PREFILLING and RUNNING, in admission order
        self.pending: dict[bytes, Sequence] = {}  # prefix key -> the sequence prefilling it
        self.last_step_prefilled = False  # the last plan was a prefill call
        self.admissions = 0
        self.preemptions = 0
        self.prefix_cache_hits = 0  # pages found in the prefix cache
        self.prefilled_tokens = 0

    # ------------------------------------------------------------------ the contract

    def add(self, seq: Sequence) -> None:
        """Track a new sequence: queued, or finished at once (reason "length") when it has
        nothing to generate (max_new_tokens 0)."""
        self.requests.setdefault(seq.request_id, []).append(seq)
        if seq.sampling.max_new_tokens == 0:
            seq.status, seq.finish_reason = Status.FINISHED, "length"
        else:
            self.waiting.append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sample of a request now (reason "abort"), its pages and slot freed.
        Returns them. Raises KeyError for a request not in the scheduler."""
        seqs = self.requests.pop(request_id)
        for seq in seqs:
            if seq in self.waiting:
                self.waiting.remove(seq)
            self.finish(seq, "abort")
        return seqs

    def schedule(self, mixed: bool = False) -> SchedulerPlan:
        """Admit waiting sequences, then plan the step: a prefill call when prompts wait for
        one, unless sequences run, the last step prefilled and this call would complete no
        prompt (then they decode: a long prompt's chunks and decode chunks take turns); else
        a decode chunk for every running sequence, preempting as pages require (all of
        them, in a corner case: then nothing runs). Calls that complete prompts run back to
        back (vLLM v0's prefill-first order: each gives its prompts their first token), at
        most until every slot is taken: arrivals cannot starve the running sequences past
        the slots they fill. With `mixed` (the engine runs mixed steps, `inference.mixed`),
        prompts go in as `mixed_work` and, when every running sequence can (`mixable`), one
        call prefills and decodes a chunk of `decode_chunk` tokens of each of them (a mixed
        step, then decode steps: stall-free batching), no turns."""
        self.admit()
        prefilling = any(s.status == Status.PREFILLING for s in self.active)
        if mixed and prefilling and self.running() and all(map(self.mixable, self.running())):
            preempted = self.reserve_decode(self.decode_chunk)
            decode = self.running()
            return SchedulerPlan(prefill=self.mixed_work(len(decode)), decode=decode,
                                 preempted=preempted, mixed=True)
        work = self.mixed_work(0) if mixed else self.prefill_work()
        completes = any(w.completes for w in work)
        if work and not (self.running() and self.last_step_prefilled and not completes):
            self.last_step_prefilled = True
            return SchedulerPlan(prefill=work, mixed=mixed)
        if not self.running():
            return SchedulerPlan()
        self.last_step_prefilled = False
        preempted = self.reserve_decode(self.decode_chunk)
        return SchedulerPlan(decode=self.running(), preempted=preempted)

    def update(self, plan: SchedulerPlan, results: list[SequenceResult]) -> None:
        """Advance the sequences by what the device returned for `plan`: the prefilled
        chunks (`prefilled`), then each result's tokens; a sequence that finished is freed."""
        self.prefilled(plan.prefill)
        for result in results:
            seq = result.seq
            seq.output += result.tokens
            seq.logprobs += result.logprobs
            seq.top_logprobs += result.top_logprobs
            if result.finish_reason is not None:
                n = result.num_tokens
                del seq.output[n:], seq.logprobs[n:], seq.top_logprobs[n:]
                self.finish(seq, result.finish_reason)

    def finish(self, seq: Sequence, reason: str) -> None:
        """A sequence is done (for `reason`): its pages and slot are freed."""
        self.free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def finished_requests(self) -> list[str]:
        """Stop tracking the requests whose samples have all finished; returns their ids."""
        done = [r for r, seqs in self.requests.items()
                if all(q.status == Status.FINISHED for q in seqs)]
        for request_id in done:
            del self.requests[request_id]
        return done

    def running(self) -> list[Sequence]:
        """The sequences in the decode batch, in admission order."""
        return [s for s in self.active if s.status == Status.RUNNING]

    # ------------------------------------------------------------------ the policy

    def _shares(self, seq: Sequence) -> bool:
        """Whether `seq` looks up and registers prefix pages: with prefix caching on, or
        among the n samples of one request (which share their prompt's pages either way)."""
        return self.prefix_caching or seq.sampling.n > 1

    def admit(self) -> None:
        """Move waiting sequences into free slots, first come first served, while their
        prompt (and, for a preempted one, its output so far) fits the free pages beyond
        those the running sequences' next decode chunk needs (vLLM's watermark: a sequence
        preempted for pages is not admitted back into them, to be preempted again after its
        recompute). A sequence whose next prefix page is being prefilled by an admitted one
        (requests with the same prefix arriving together; the n samples of a request) waits
        until it is written, so it shares the page instead of computing it again."""
        reserve = sum(self._pages_wanted(s, self.decode_chunk) for s in self.running())
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            # A "crop" request past the context (preempted) resumes from its last max_seq_len
            # tokens: prefilled from position 0, they predict its next token (nanoGPT's crop).
            target = (seq.prompt + seq.output)[-self.max_seq_len:]
            keys = page_hashes(target[:-1], self.page_size) if self._shares(seq) else []
            hits = self.pool.lookup(keys)
            if len(hits) < len(keys) and keys[len(hits)] in self.pending:
                return
            needed = self._pages_for(len(target)) - len(hits)
            # hits that are evictable are no longer free once retained
            if needed + sum(self.pool.refs[p] == 0 for p in hits) + reserve > \
                    self.pool.num_free():
                return
            self.waiting.popleft()
            for page in hits:
                self.pool.retain(page)
            seq.pages = hits + [self.pool.allocate() for _ in range(needed)]
            seq.slot = heapq.heappop(self.free_slots)
            seq.target, seq.prefilled = target, len(hits) * self.page_size
            seq.registered = len(hits)
            seq.status, seq.admitted = Status.PREFILLING, self.admissions
            self.admissions += 1
            self.prefix_cache_hits += len(hits)
            self.active.append(seq)
            for key in keys[len(hits):]:  # pages this sequence will write: others wait for them
                if key not in self.pool.page_of:
                    self.pending.setdefault(key, seq)

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every `(rows, T)` a prefill call can take, the shapes `Engine.warmup` compiles: T a
        power of two from 16 up to the bucket of a row's most tokens (min of
        `max_prefill_tokens` and `prefill_chunk_tokens`), and for each T one row (a lone
        prompt: no padding rows) or the most rows, a power of two up to the bucket of
        max_slots, with rows x T at most `max_prefill_tokens` (several prompts: the call's
        whole budget). Two row counts per T, not every power of two, and no lone row at
        T = 16 below a longer T (a lone prompt of at most 16 tokens pads to 32) keep the
        warmup within 12 programs for the Engine's and `serve`'s defaults (issue 39); by
        T, then rows, ascending."""
        budget = self.max_prefill_tokens
        longest = bucket(min(budget, self.prefill_chunk_tokens), MIN_PROMPT_BUCKET)
        shapes, T = [], MIN_PROMPT_BUCKET
        while T <= longest:
            most = 1
            while most * 2 <= bucket(self.max_slots) and most * 2 * T <= budget:
                most *= 2
            lone = T > MIN_PROMPT_BUCKET or T == longest  # else pads to the next T
            shapes += [(rows, T) for rows in sorted({1, most}) if rows == most or lone]
            T *= 2
        return shapes

    def prefill_work(self) -> list[PrefillWork]:
        """Chunks of the prefilling sequences for one prefill call, in admission order. The
        call takes one of `prefill_shapes()`, each row one sequence's next chunk of at most T
        and `prefill_chunk_tokens` tokens (vLLM's long_prefill_token_threshold: a long prompt
        goes in small chunks, each stalling the running requests briefly, while short ones
        share the call). For each T the rows are the fewest that hold every prefilling
        sequence, or the most the budget allows; of those shapes, the one that puts the most
        prompt tokens through is chosen (on a tie, the longer T: the first prompts complete
        sooner). A row's padding costs as much as a token, so several prompts' chunks, not
        one prompt padded to the bucket above it, fill the call."""
        seqs = [s for s in self.active if s.status == Status.PREFILLING]
        if not seqs:
            return []
        rows_by_T: dict[int, int] = {}
        for rows, T in self.prefill_shapes():  # ascending rows: stop at the first that holds all
            if rows_by_T.get(T, 0) < len(seqs):
                rows_by_T[T] = rows
        best = (0, [])
        for T, rows in rows_by_T.items():
            n_max = min(T, self.max_prefill_tokens, self.prefill_chunk_tokens)
            work = [PrefillWork(s, s.prefilled, min(len(s.target) - s.prefilled, n_max))
                    for s in seqs[:rows]]
            tokens = sum(w.n for w in work)
            if tokens >= best[0]:
                best = (tokens, work)
        return best[1]

    def mixable(self, seq: Sequence) -> bool:
        """Whether a running sequence can decode inside a mixed chunk (a mixed step, then
        decode steps: `decode_chunk` tokens): not speculative, and no token of the chunk past
        the context (a "crop" request there needs its window forward,
        `inference.steps.window_logits`)."""
        sp = seq.sampling
        return not sp.speculative and (seq.length + self.decode_chunk <= self.max_seq_len
                                       or len(seq.prompt) + sp.max_new_tokens <= self.max_seq_len)

    def mixed_shapes(self) -> list[int]:
        """Every count of prompt tokens a mixed step can take besides its decode tokens: the
        bucket of the budget (`mixed_work`) and the two powers of two below it, at least
        MIN_PROMPT_BUCKET (a smaller chunk pads to the least: few programs), ascending."""
        most = bucket(self.max_prefill_tokens, MIN_PROMPT_BUCKET)
        return sorted({max(most >> k, MIN_PROMPT_BUCKET) for k in range(3)})

    def mixed_rows(self, n_decode: int) -> int:
        """Decode rows of a mixed step that decodes `n_decode` sequences, gathered compactly:
        half the slots when they fit, else all (two programs per prompt shape)."""
        half = self.max_slots // 2
        return half if half and n_decode <= half else self.max_slots

    def mixed_work(self, n_decode: int) -> list[PrefillWork]:
        """Chunks of the prefilling sequences for a mixed chunk that also decodes `n_decode`
        sequences `decode_chunk` tokens each, in admission order. The prompt budget is
        `mixed_budget` of the prompt tokens behind the first prefilling sequence (the other
        prefilling sequences' rest, the queued sequences' prompt and output). Each sequence
        at most `prefill_chunk_tokens` per call, its chunk taking whole query blocks of the
        budget (`gpt_jax.ragged.QUERY_BLOCK`). A short prompt (its whole target within one
        chunk) goes in whole past the budget while the call's blocks stay within
        `max_prefill_tokens`, as a prefill call would take it: its first token one call
        after it is admitted; a long one keeps the budget (the stall bound)."""
        seqs = [s for s in self.active if s.status == Status.PREFILLING]
        queued = (sum(len(s.target) - s.prefilled for s in seqs[1:])
                  + sum(min(s.length, self.max_seq_len) for s in self.waiting))
        budget = mixed_budget(n_decode, queued, self.decode_chunk, self.max_prefill_tokens)
        room, work = self.max_prefill_tokens, []  # room: the call's cap, in whole blocks
        for seq in seqs:
            rest = len(seq.target) - seq.prefilled
            short = (len(seq.target) <= self.prefill_chunk_tokens
                     and bucket_up(rest, MIN_PROMPT_BUCKET) <= room)
            n = rest if short else min(rest, self.prefill_chunk_tokens, budget)
            if n > 0:
                work.append(PrefillWork(seq, seq.prefilled, n))
                budget -= bucket_up(n, MIN_PROMPT_BUCKET)
                room -= bucket_up(n, MIN_PROMPT_BUCKET)
        return work

    def prefilled(self, work: list[PrefillWork]) -> None:
        """Record a prefill call: advance each sequence and cache its newly full pages."""
        for w in work:
            seq = w.seq
            seq.prefilled += w.n
            self.prefilled_tokens += w.n
            if self._shares(seq):
                keys = page_hashes(seq.target[: seq.prefilled], self.page_size)
                for i in range(seq.registered, len(keys)):
                    self.pool.register(seq.pages[i], keys[i])
                    if self.pending.get(keys[i]) is seq:
                        del self.pending[keys[i]]
                seq.registered = len(keys)
            if w.completes:
                seq.status = Status.RUNNING

    def reserve_decode(self, chunk: int) -> list[Sequence]:
        """Give every running sequence the pages its next `chunk` tokens need. When too few
        pages are free, preempt the most recently admitted active sequence (its pages and
        slot freed, its output kept; it is recomputed when admitted again) until the rest
        fit. Returns the preempted sequences."""
        preempted = []
        while True:
            running = [s for s in self.active if s.status == Status.RUNNING]
            wants = {id(s): self._pages_wanted(s, chunk) for s in running}
            if sum(wants.values()) <= self.pool.num_free():
                break
            victim = max(self.active, key=lambda s: s.admitted)
            self.preempt(victim)
            preempted.append(victim)
        for seq in running:
            for _ in range(wants[id(seq)]):
                seq.pages.append(self.pool.allocate())
        return preempted

    def preempt(self, seq: Sequence) -> None:
        """Free an active sequence's pages and slot and put it at the front of the queue,
        its output kept: admitted again, it is recomputed from its prompt and output."""
        self.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _pages_wanted(self, seq: Sequence, chunk: int) -> int:
        sp = seq.sampling  # a speculative step may emit its drafts and one more token
        per_step = 1 + (sp.num_speculative_tokens if sp.speculative else 0)
        end = min(seq.length + chunk * per_step, len(seq.prompt) + sp.max_new_tokens,
                  self.max_seq_len)  # a "crop" request's cache stops at max_seq_len
        return max(0, self._pages_for(end) - len(seq.pages))

    def free(self, seq: Sequence) -> None:
        """Release a sequence's pages and slot (finished, aborted or preempted)."""
        if seq in self.active:
            self.active.remove(seq)
        for key in [k for k, owner in self.pending.items() if owner is seq]:
            del self.pending[key]
        if seq.slot is not None:
            heapq.heappush(self.free_slots, seq.slot)
        self.pool.release(seq.pages)
        seq.pages, seq.slot = [], None

    def _pages_for(self, n_tokens: int) -> int:
        """Pages that hold `n_tokens` tokens (`gpt_jax.cache.pages_for`, which imports JAX)."""
        return -(-n_tokens // self.page_size)
