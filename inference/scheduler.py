"""The host side of `inference.Engine`: sequences and their states, the page allocator with
automatic prefix caching, and the choice of what to prefill, decode or preempt each step.

Nothing here touches the device: it decides page tables and batches of work, which the
engine's jitted programs then run.

Prefix caching (vLLM's automatic prefix caching): a full page is keyed by a hash of its
tokens and of every token before it (a chain of digests, one per page), so equal keys mean
equal keys and values in the page. Pages are reference-counted; a cached page whose last
user let go stays cached (evictable, least recently used first) until a new page is
needed and no never-cached page is free.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import heapq

import numpy as np

from gpt_jax.cache import NO_PAGE, pages_for
from inference.sampling import SamplingParams

MIN_PROMPT_BUCKET = 16  # the shortest padded prompt length of a prefill call


def page_hashes(tokens: list[int], page_size: int) -> list[bytes]:
    """The prefix-cache key of each full page of `tokens`: a digest of the page's tokens and
    the previous page's key (BLAKE2b, 16 bytes), so a key names the whole prefix."""
    keys, parent = [], b""
    for lo in range(0, len(tokens) - page_size + 1, page_size):
        page = np.asarray(tokens[lo: lo + page_size], np.int64).tobytes()
        parent = hashlib.blake2b(parent + page, digest_size=16).digest()
        keys.append(parent)
    return keys


class PagePool:
    """Reference-counted pages with a prefix cache. Page ids index the device pools."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refs = np.zeros(num_pages, np.int64)
        self.free = collections.deque(range(num_pages))  # never cached, unused
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        self.page_of: dict[bytes, int] = {}  # prefix key -> cached page
        self.key_of: dict[int, bytes] = {}  # cached page -> its key

    def num_free(self) -> int:
        """Pages that can be handed out now (unused, cached or not)."""
        return len(self.free) + len(self.evictable)

    def allocate(self) -> int:
        """A page for a new user (refs 1). Raises IndexError when none is free."""
        if self.free:
            page = self.free.popleft()
        else:
            page, _ = self.evictable.popitem(last=False)  # least recently used
            del self.page_of[self.key_of.pop(page)]
        self.refs[page] = 1
        return page

    def retain(self, page: int) -> None:
        """One more user of a cached page."""
        self.evictable.pop(page, None)
        self.refs[page] += 1

    def release(self, pages: list[int]) -> None:
        """Users let go: a page nobody uses goes back to the free list, or stays cached."""
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.key_of:
                    self.evictable[page] = None
                else:
                    self.free.append(page)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached pages of the longest run of `keys` from the start."""
        pages = []
        for key in keys:
            if key not in self.page_of:
                break
            pages.append(self.page_of[key])
        return pages

    def register(self, page: int, key: bytes) -> None:
        """Cache a full, written page under `key` (a page already cached keeps its key)."""
        if key not in self.page_of and page not in self.key_of:
            self.page_of[key], self.key_of[page] = page, key


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


class Scheduler:
    """Queues, slots and pages. `Engine` calls, each step: `admit`, `prefill_work`,
    `reserve_decode` (which may preempt), and `free` for finished or aborted sequences."""

    def __init__(self, *, max_slots: int, num_pages: int, page_size: int, max_seq_len: int,
                 max_prefill_tokens: int, prefill_chunk_tokens: int, prefix_caching: bool):
        self.max_slots, self.page_size, self.max_seq_len = max_slots, page_size, max_seq_len
        self.max_pages = pages_for(max_seq_len, page_size)
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefix_caching = prefix_caching
        self.pool = PagePool(num_pages)
        self.free_slots = list(range(max_slots))  # a heap: the lowest slot first
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.active: list[Sequence] = []  # PREFILLING and RUNNING, in admission order
        self.pending: dict[bytes, Sequence] = {}  # prefix key -> the sequence prefilling it
        self.page_table = np.full((max_slots, self.max_pages), NO_PAGE, np.int32)
        self.admissions = 0
        self.preemptions = 0
        self.prefix_cache_hits = 0  # pages found in the prefix cache
        self.prefilled_tokens = 0

    def _shares(self, seq: Sequence) -> bool:
        """Whether `seq` looks up and registers prefix pages: with prefix caching on, or
        among the n samples of one request (which share their prompt's pages either way)."""
        return self.prefix_caching or seq.sampling.n > 1

    def admit(self) -> None:
        """Move waiting sequences into free slots, first come first served, while their
        prompt (and, for a preempted one, its output so far) fits the free pages. A sequence
        whose next prefix page is being prefilled by an admitted one (requests with the same
        prefix arriving together; the n samples of a request) waits until it is written, so
        it shares the page instead of computing it again."""
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            # A "crop" request past the context (preempted) resumes from its last max_seq_len
            # tokens: prefilled from position 0, they predict its next token (nanoGPT's crop).
            target = (seq.prompt + seq.output)[-self.max_seq_len:]
            keys = page_hashes(target[:-1], self.page_size) if self._shares(seq) else []
            hits = self.pool.lookup(keys)
            if len(hits) < len(keys) and keys[len(hits)] in self.pending:
                return
            needed = pages_for(len(target), self.page_size) - len(hits)
            # hits that are evictable are no longer free once retained
            if needed + sum(self.pool.refs[p] == 0 for p in hits) > self.pool.num_free():
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
            self._set_table(seq)
            for key in keys[len(hits):]:  # pages this sequence will write: others wait for them
                if key not in self.pool.page_of:
                    self.pending.setdefault(key, seq)

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every `(rows, T)` a prefill call can take, the shapes `Engine.warmup` compiles: T a
        power of two from 16 up to the bucket of a row's most tokens (min of
        `max_prefill_tokens` and `prefill_chunk_tokens`), rows a power of two up to the
        bucket of max_slots with rows x T at most `max_prefill_tokens` (or one row); by T,
        then rows, ascending."""
        budget = self.max_prefill_tokens
        longest = bucket(min(budget, self.prefill_chunk_tokens), MIN_PROMPT_BUCKET)
        shapes, T = [], MIN_PROMPT_BUCKET
        while T <= longest:
            rows = 1
            while rows <= bucket(self.max_slots) and (rows == 1 or rows * T <= budget):
                shapes.append((rows, T))
                rows *= 2
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
            self.free(victim)
            victim.status = Status.WAITING
            self.waiting.appendleft(victim)
            self.preemptions += 1
            preempted.append(victim)
        for seq in running:
            for _ in range(wants[id(seq)]):
                seq.pages.append(self.pool.allocate())
            self._set_table(seq)
        return preempted

    def _pages_wanted(self, seq: Sequence, chunk: int) -> int:
        end = min(seq.length + chunk, len(seq.prompt) + seq.sampling.max_new_tokens,
                  self.max_seq_len)  # a "crop" request's cache stops at max_seq_len
        return max(0, pages_for(end, self.page_size) - len(seq.pages))

    def free(self, seq: Sequence) -> None:
        """Release a sequence's pages and slot (finished, aborted or preempted)."""
        if seq in self.active:
            self.active.remove(seq)
        for key in [k for k, owner in self.pending.items() if owner is seq]:
            del self.pending[key]
        if seq.slot is not None:
            self.page_table[seq.slot] = NO_PAGE
            heapq.heappush(self.free_slots, seq.slot)
        self.pool.release(seq.pages)
        seq.pages, seq.slot = [], None

    def _set_table(self, seq: Sequence) -> None:
        row = self.page_table[seq.slot]
        row[:] = NO_PAGE
        row[: len(seq.pages)] = seq.pages


def bucket(n: int, floor: int = 1) -> int:
    """The power of two at or above `n` (and `floor`): padded sizes, so few programs."""
    return max(floor, 1 << max(0, n - 1).bit_length())
