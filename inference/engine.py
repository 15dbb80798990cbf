"""`Engine`: continuous batching over one paged KV cache, as plan, run, update.

Each step the scheduler (`inference.scheduler`) plans the work (admission, a prefill call
or a chunk of decode steps, preemption), `Engine` runs the plan's program on its one
long-lived decode state (`inference.batching`: `engine_prefill`, `engine_decode`, the same
row functions and decode loop as `generate`), reads back what it produced, and the
scheduler advances the sequences from it; the outputs are then built, with a tokenizer
detokenized and cut at stop strings (`inference.detokenize`). Requests join and leave
between chunks. `compile_counts()` reports how many programs each jitted entry point has
compiled.
"""

from __future__ import annotations

import collections
import contextlib
import numbers
import secrets

import jax
import jax.numpy as jnp
import numpy as np

from gpt_jax import cache as kv
from gpt_jax import tensor_parallel
from gpt_jax.config import GPTConfig
from gpt_jax.params import inference_params
from inference import stopping, warmup
from inference.batching import (decode_rows, engine_decode, engine_prefill, prefill_batch,
                                prefill_shape, row_arrays, sequence_results)
from inference.constraint_mask import warmup_arrays
from inference.constraints import automaton
from inference.decode import CHUNK, empty_state, widen_recent
from inference.detokenize import RequestOutput, request_output, sequence_text
from inference.draft_engine import EngineDraft, draft_prefill, engine_draft_speculate
from inference.generation import generate_program
from inference.mixed import blocks, engine_mixed, mixed_batch
from inference.sampling import prompt_hash
from inference.sampling_params import SamplingParams
from inference.scheduler import PrefillWork, Scheduler, Sequence, Status
from inference.spec_engine import SpecSlots, engine_speculate, speculate
from inference.speculative import width_of
from inference.steps import PAGE_SIZE, decode_step, prefill
from inference.validation import check_engine_request
from inference.transfer import to_device

FINISHED_IDS = 100_000  # finished request ids an Engine remembers (abort of one: no error)


def compile_counts() -> dict[str, int]:
    """Programs compiled so far by each jitted entry point (their jit cache sizes)."""
    fns = {"prefill": prefill, "decode_step": decode_step, "generate": generate_program,
           "engine_prefill": engine_prefill, "engine_decode": engine_decode,
           "engine_speculate": engine_speculate, "engine_mixed": engine_mixed,
           "draft_prefill": draft_prefill, "engine_draft_speculate": engine_draft_speculate}
    return {name: fn._cache_size() for name, fn in fns.items()}


def _pool_pages(config, default: int, num_pages, kv_cache_bytes, page_size: int, dtype) -> int:
    """The page pool's size: `num_pages`, or as many pages as `kv_cache_bytes` holds, or
    `default`. Raises ValueError for a byte budget below one page."""
    if kv_cache_bytes is not None:
        page_bytes = kv.cache_bytes(config, 1, page_size, dtype)
        num_pages = int(kv_cache_bytes) // page_bytes
        if num_pages < 1:
            raise ValueError(f"Engine kv_cache_bytes={kv_cache_bytes} holds no page; one "
                             f"page of {page_size} tokens takes {page_bytes} bytes")
    return default if num_pages is None else int(num_pages)


class Engine:
    """Continuous batching (Orca's iteration-level scheduling, Yu et al. 2022) over one paged
    KV cache (PagedAttention, Kwon et al. 2023), in the shape of vLLM's `LLMEngine`.

        engine = Engine(params, config, tokenizer=None, max_slots=16)
        engine.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=20))
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.request_id, out.new_token_ids, out.finished)

    Each `step()` is plan, run, update. The scheduler (`inference.scheduler`) admits waiting
    requests into free slots and plans either a prefill call of up to `max_prefill_tokens`
    prompt tokens (a long prompt goes in over several steps: chunked prefill), which samples
    the first token of every prompt it completes, or one chunk of `CHUNK` decode steps for
    every running request (gathered compactly) as one compiled `lax.scan`. With both to do, a
    mixed chunk (`inference.mixed`) runs a prompt chunk with the first of CHUNK decode steps
    of every running request in one call (without mixed steps, or for speculative rows or
    "crop" rows near the context, a prefill call that completes prompts runs first, and
    one that only advances a long prompt takes turns with the decode chunks:
    `Scheduler.schedule`). When the pages cannot hold
    the next chunk of every running request, the most recently admitted request is
    preempted (pages freed, output kept) and recomputed when a slot and pages free up. The
    engine runs the plan's program; the scheduler advances the sequences from what it
    returned and frees the pages and slot of every request that finished. Requests join and
    leave between chunks.
    With `prefix_caching`, full prompt pages are shared by requests whose prompts start
    alike (`inference.pages`). A "crop" request (`SamplingParams.context_overflow`) holds at
    most max_seq_len tokens of pages; past that, the decode chunks run its window
    (`inference.steps.window_logits`) for it and any other crop row near the context, no
    other row. A request's tokens do not depend on when it arrived or on its neighbours:
    every row samples from its own seed, sample index and step.

    Args:
      params: model weights (either layout); config: their GPTConfig.
      tokenizer: encodes string prompts and decodes `text`; needed for stop strings and
        structured output (`SamplingParams.json_schema`, `regex`, `choice`, `json_object`).
      max_slots: most requests (samples) decoded at once.
      num_pages, kv_cache_bytes: the page pool's size, in pages or in bytes
        (`gpt_jax.cache.cache_bytes`); default: every slot can hold max_seq_len tokens.
      page_size: token slots per page.
      cache_dtype: "float32" or "bfloat16" (weights are cast to it too, as in `LLM`, unless
        quantized).
      quantize: None, or "int8": weights quantized once, here, to int8 with a float32 scale
        per output channel (`gpt_jax.params.quantize`; LayerNorm, biases, activations and
        logits float32). Params already quantized are run as they are.
      prefix_caching: share full prompt pages between requests (automatic prefix caching).
      max_prefill_tokens: most prompt tokens prefilled per step (the call's budget): rows x
        padded length of the call, filled with several prompts' chunks
        (`Scheduler.prefill_work`).
      prefill_chunk_tokens: most tokens of one prompt per prefill step (vLLM's
        long_prefill_token_threshold). A prefill step stalls the running requests once:
        smaller chunks bound the stall a long prompt causes, while a larger call budget
        admits short arriving prompts two at a time (the defaults' measurements:
        benchmarks/README.md, "Serving").
      mesh: a `jax.sharding.Mesh` with a "model" axis: weights and KV pages split over it
        (`gpt_jax.tensor_parallel`), the same tokens as on one device; `stats()["mesh"]`.
      mixed_steps: True: prompts are prefilled inside the decode chunks of the running
        requests (`inference.mixed`; not with a mesh), a prompt budget per call of a share
        of its decode tokens plus the prompt tokens queued (`buckets.mixed_budget`, at
        most `max_prefill_tokens`); False (the default): prefill calls and decode chunks take
        turns. Both give the same tokens (benchmarks/README.md, "Serving": the figures).
      draft: `(params, config)` of a draft model for `speculative="draft"` requests
        (`inference.draft_engine`; not with a mesh or mixed steps).
    Raises:
      ValueError: a size that is not an int >= 1 (the message names it), both num_pages and
        kv_cache_bytes given, kv_cache_bytes below one page, prefix_caching not a bool, a
        tokenizer without encode/decode, another cache dtype, a quantize other than None or
        `gpt_jax.params.QUANTIZE`, a page_size above config.max_seq_len (and 16), params
        that do not match `config`, or a mesh they do not fit
        (`gpt_jax.tensor_parallel.check_mesh`), a draft that cannot draft for the model
        (`inference.draft.check_draft`). (A pool too small for some request is found
        per request, by add_request.)
    """

    def __init__(self, params, config: GPTConfig, tokenizer=None, *, max_slots: int = 16,
                 num_pages: int | None = None, kv_cache_bytes: int | None = None,
                 page_size: int = PAGE_SIZE, cache_dtype="float32", prefix_caching: bool = True,
                 max_prefill_tokens: int = 128, prefill_chunk_tokens: int = 64,
                 quantize: str | None = None, mesh=None, mixed_steps: bool = False,
                 draft=None):
        sizes = dict(max_slots=max_slots, page_size=page_size,
                     max_prefill_tokens=max_prefill_tokens,
                     prefill_chunk_tokens=prefill_chunk_tokens, num_pages=num_pages,
                     kv_cache_bytes=kv_cache_bytes)
        for name, value in sizes.items():
            if value is None and name in ("num_pages", "kv_cache_bytes"):
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Engine {name} must be an int >= 1, got {value!r}")
        max_slots, page_size, max_prefill_tokens, prefill_chunk_tokens = map(
            int, (max_slots, page_size, max_prefill_tokens, prefill_chunk_tokens))
        if num_pages is not None and kv_cache_bytes is not None:
            raise ValueError("give the Engine num_pages or kv_cache_bytes, not both")
        for name, flag in (("prefix_caching", prefix_caching), ("mixed_steps", mixed_steps)):
            if not isinstance(flag, bool):
                raise ValueError(f"Engine {name} must be True or False, got {flag!r}")
        if tokenizer is not None and not (hasattr(tokenizer, "encode")
                                          and hasattr(tokenizer, "decode")):
            raise ValueError(f"Engine tokenizer must have encode and decode, got {tokenizer!r}")
        try:
            dtype = jnp.dtype(cache_dtype)
        except TypeError:
            dtype = None
        if dtype is None or dtype.name not in ("float32", "bfloat16"):
            raise ValueError(f"Engine cache_dtype must be float32 or bfloat16, got {cache_dtype!r}")
        if draft is not None and (mesh is not None or mixed_steps):
            raise ValueError("an Engine with a draft model runs without mesh and mixed_steps")
        if page_size > max(config.max_seq_len, PAGE_SIZE):  # a page past the context
            raise ValueError(f"Engine page_size must be at most the model's max_seq_len "
                             f"{config.max_seq_len} (or {PAGE_SIZE}), got {page_size}")
        self.mesh, model_config = mesh, config
        config = tensor_parallel.sharded_config(config, mesh)  # kv heads it replicates
        max_pages = kv.pages_for(config.max_seq_len, page_size)
        num_pages = _pool_pages(config, max_slots * max_pages, num_pages, kv_cache_bytes,
                                page_size, dtype)
        self.params = inference_params(params, model_config, dtype, quantize,
                                       panels=mesh is None)
        if mesh is not None:  # Megatron-style
            self.params, _ = tensor_parallel.shard_params(self.params, model_config, mesh)
        self.config, self.tokenizer, self.cache_dtype = config, tokenizer, dtype
        self.max_slots, self.num_pages, self.page_size = max_slots, num_pages, page_size
        self.max_pages = max_pages
        self.scheduler = Scheduler(max_slots=max_slots, num_pages=num_pages,
                                   page_size=page_size, max_seq_len=config.max_seq_len,
                                   max_prefill_tokens=max_prefill_tokens,
                                   prefill_chunk_tokens=prefill_chunk_tokens,
                                   prefix_caching=prefix_caching, decode_chunk=CHUNK)
        # the stop arrays' widths (EOS ids, stop sequences, sequence length), grown on demand
        self.widths = (4, 4, 4)
        # The token buffer is a ring of C (>= one chunk) steps: the host reads every chunk.
        self.state = empty_state(config, num_pages, max_slots, max_pages, page_size, dtype,
                                 self.widths, max(config.max_seq_len, CHUNK))
        if mesh is not None:
            self.state = tensor_parallel.replicate(self.state, mesh)
        # ids of finished requests (aborting one does nothing), the latest FINISHED_IDS kept
        self.finished_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.finished_at_once: list[Sequence] = []  # max_new_tokens = 0: output next step
        self.arrivals = 0
        # None: step() runs the jitted programs (`inference.exported.attach` sets exported ones)
        self.prefill_program = self.decode_program = self.mixed_program = None
        self.mixed = mixed_steps and mesh is None  # prompts go in with the decode tokens
        self.spec = SpecSlots(max_slots)  # speculative rows' draft state and counters
        # the draft model of speculative="draft" requests (`inference.draft_engine`)
        self.draft = None if draft is None else EngineDraft(
            draft, config, num_pages=num_pages, max_slots=max_slots, max_pages=max_pages,
            page_size=page_size, dtype=dtype, quantize=quantize)

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: list[int] | str,
                    sampling: SamplingParams | None = None) -> None:
        """Queue a request. Raises RequestError (a ValueError; before it is queued, and the
        engine keeps serving the others) for a duplicate request_id, an empty prompt or one
        with ids outside the vocabulary, a prompt + max_new_tokens past max_seq_len or past
        what the page pool can ever hold, stop strings or a text prompt without a tokenizer;
        TypeError for sampling that is not SamplingParams (`check_request`)."""
        prompt, sampling = self.check_request(request_id, prompt, sampling)
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(32)
        seqs = [Sequence(request_id, k, prompt, sampling, seed, prompt_hash(prompt),
                         self.arrivals)
                for k in range(sampling.n)]
        self.arrivals += 1
        self.finished_ids.pop(request_id, None)
        self.widths = tuple(np.maximum(self.widths, stopping.needed_widths(
            [sampling.stop_token_ids], [sampling.stop_sequences])))
        self.state = widen_recent(self.state, self.widths[2])  # longer stop sequences
        for seq in seqs:
            self.scheduler.add(seq)
        self.finished_at_once += [q for q in seqs if q.status == Status.FINISHED]

    def check_request(self, request_id: str, prompt, sampling: SamplingParams | None):
        """Every check of one request, before anything is queued (the engine keeps serving
        the others): `inference.validation.check_engine_request`. Returns `(prompt,
        sampling)`. Raises RequestError naming the request, or TypeError for sampling that
        is not SamplingParams."""
        return check_engine_request(self, request_id, prompt, sampling)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its pages and slot; `step()` returns nothing more for
        it. Aborting a finished request does nothing; an unknown request_id raises
        KeyError."""
        if request_id in self.finished_ids:
            return
        if request_id not in self.scheduler.requests:
            raise KeyError(f"unknown request_id {request_id!r}")
        for seq in self.scheduler.abort(request_id):
            if seq in self.finished_at_once:
                self.finished_at_once.remove(seq)
        self._remember_finished(request_id)

    def warmup(self, crop: bool = False,
               constraints: collections.abc.Sequence[SamplingParams] = ()) -> int:
        """Compile every program `step()` can run (each mixed step's token count, or without
        mixed steps each prefill shape, and each decode batch size; with `crop`, also each
        count of rows that outgrow the context, for "crop" requests:
        `inference.warmup.programs`) with nothing in the engine, so none compiles while
        requests wait. With `constraints` (structured-output requests' SamplingParams,
        compiled with the engine's tokenizer), also each program's constrained variant for
        the smallest table size and for theirs (`constraint_mask.warmup_arrays`). Returns
        how many programs it compiled. Raises RuntimeError when the engine holds requests,
        ValueError for SamplingParams without a constraint, RequestError for a constraint
        that cannot be compiled."""
        if self.scheduler.requests:
            raise RuntimeError("warm the Engine up before adding requests")
        tables = [automaton(sp, self.tokenizer, self.config.vocab_size) for sp in constraints]
        if None in tables:
            raise ValueError(f"Engine.warmup constraints are requests' SamplingParams with a "
                             f"constraint, got {constraints[tables.index(None)]!r}")
        with self.on_mesh():
            rows, stops = self._row_arrays()
            banks = warmup_arrays(tables, self.max_slots, self.config.vocab_size) \
                if constraints else []
            before = sum(compile_counts().values())
            for variant in [rows] + [rows.replace(constraint=b) for b in banks]:
                warmup.compile_all(self, crop, variant, stops)
            self.spec.warmup(self._spec_arrays())
            return sum(compile_counts().values()) - before

    def _remember_finished(self, request_id: str) -> None:
        self.finished_ids[request_id] = None
        if len(self.finished_ids) > FINISHED_IDS:
            self.finished_ids.popitem(last=False)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests)

    def stats(self) -> dict:
        """Counters: pages (total, free, in use, cached), slots, queue lengths, preemptions,
        prefix cache hits (pages reused instead of prefilled: from the prefix cache, and,
        with caching on or off, between the n samples of one request), prefilled tokens
        (tokens run through prefill) and the mesh (`gpt_jax.tensor_parallel.mesh_stats`)."""
        s = self.scheduler
        return {"total_pages": self.num_pages, "free_pages": s.pool.num_free(),
                "pages_in_use": self.num_pages - s.pool.num_free(),
                "cached_pages": len(s.pool.key_of), "max_slots": self.max_slots,
                "running": sum(q.status == Status.RUNNING for q in s.active),
                "prefilling": sum(q.status == Status.PREFILLING for q in s.active),
                "waiting": len(s.waiting), "preemptions": s.preemptions,
                "prefix_cache_hits": s.prefix_cache_hits, "prefilled_tokens": s.prefilled_tokens,
                "mesh": tensor_parallel.mesh_stats(self.mesh, self.config, self.num_pages,
                                                   self.page_size, self.cache_dtype),
                **self.spec.stats()}

    def on_mesh(self):
        """The context the engine's programs are traced and run in: its mesh, if any."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    # ------------------------------------------------------------------ one iteration

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: plan (`Scheduler.schedule`: admit waiting requests, then
        either a prefill call, whose completed prompts get their first token, or a chunk of
        decode steps for every running request), run the plan's program, update the
        sequences from what it returned. Returns an output for every sample that produced
        tokens or finished in it."""
        outputs = [self._output(seq) for seq in self.finished_at_once]  # max_new_tokens = 0
        self.finished_at_once.clear()
        plan = self.scheduler.schedule(mixed=self.mixed)
        with self.on_mesh():
            if plan.mixed and plan.runs:
                self._mixed(plan.decode, plan.prefill)
            elif plan.prefill:
                self._prefill(plan.prefill)
            elif plan.decode:
                self._decode(plan.decode)
        sampled = plan.sampled
        results = sequence_results(self.state, sampled) if plan.runs else []
        old = [len(seq.output) for seq in sampled]
        self.scheduler.update(plan, results)
        outputs += [self._output(seq, n) for seq, n in zip(sampled, old)]
        for request_id in self.scheduler.finished_requests():
            self._remember_finished(request_id)
        return outputs

    def _prefill(self, work: list[PrefillWork]) -> None:
        """One prefill call: the chunks of `work`, a row each."""
        rows, stops = self._row_arrays()
        table = self._page_table()
        batch = prefill_batch(work, self.max_slots, self.config.vocab_size,
                              self.state.recent.shape[1], self.state.window.shape[1],
                              prefill_shape(self.scheduler.prefill_shapes(), work),
                              self.tokenizer)
        self.state = (self.prefill_program or engine_prefill)(
            self.params, self.config, self.state, table, batch, rows, stops, pad_id=0)
        if self.draft is not None:
            self.draft.prefill(table, batch)
        self.spec.insert([w.seq.slot for w in work if w.completes], self._spec_arrays())

    def _mixed(self, decode: list[Sequence], work: list[PrefillWork]) -> None:
        """One mixed step (`inference.mixed`): a token of each `decode` sequence and the
        chunks of `work`, in one call."""
        rows, stops = self._row_arrays()
        padded = sum(blocks(w.n) for w in work)
        n_prompt = min(n for n in self.scheduler.mixed_shapes() if n >= padded)
        n_rows = self.scheduler.mixed_rows(len(decode))
        batch = mixed_batch(decode, work, self.max_slots, self.config.vocab_size,
                            self.state.recent.shape[1], self.state.window.shape[1],
                            self.tokenizer, n_prompt=n_prompt, n_rows=n_rows)
        self.state = (self.mixed_program or engine_mixed)(
            self.params, self.config, self.state, self._page_table(), batch, rows, stops,
            n_rows=n_rows, pad_id=0)
        self.spec.insert([w.seq.slot for w in work if w.completes], self._spec_arrays())

    def _spec_arrays(self):
        return SpecSlots.arrays(self.scheduler.active, self.max_slots, self.config,
                                None if self.draft is None else self.draft.config)

    def _decode(self, running: list[Sequence]) -> None:
        """One chunk of decode steps over the running slots, gathered compactly (a
        speculative chunk, `spec_engine.speculate`: over the first slots, every running one
        among them)."""
        live = np.zeros(self.max_slots, bool)
        live[[q.slot for q in running]] = True
        n_rows = decode_rows(len(running), self.max_slots)
        rows, stops = self._row_arrays()
        window_slots = self._window_slots(running, n_rows)
        if width_of([q.sampling for q in running]) and not window_slots.shape[0]:
            speculate(self, running, to_device(live), rows, stops)  # none near a "crop"
            return
        self.state = (self.decode_program or engine_decode)(
            self.params, self.config, self.state, self._page_table(), to_device(live), rows,
            stops, window_slots, n_rows=n_rows, pad_id=0)

    def _row_arrays(self):
        """Per-slot sampling and stop arrays of the active sequences (`row_arrays`)."""
        return row_arrays(self.scheduler.active, self.max_slots, self.config.vocab_size,
                          self.widths, self.tokenizer)

    def _page_table(self):
        """int32 `[max_slots, max_pages]`: each active sequence's pages at its slot, NO_PAGE
        elsewhere."""
        table = np.full((self.max_slots, self.max_pages), kv.NO_PAGE, np.int32)
        for seq in self.scheduler.active:
            table[seq.slot, : len(seq.pages)] = seq.pages
        return to_device(table)

    def _window_slots(self, running: list[Sequence], n_rows: int):
        """The slots of the "crop" requests whose context may be full within the next chunk,
        padded with `max_slots` to a `decode_rows` bucket (none: an empty array, and the
        chunk compiles without the window forward)."""
        C = self.config.max_seq_len
        near = [q.slot for q in running if q.length + CHUNK > C
                and len(q.prompt) + q.sampling.max_new_tokens > C]  # only "crop" ones can
        slots = np.full(decode_rows(len(near), n_rows) if near else 0, self.max_slots, np.int32)
        slots[: len(near)] = sorted(near)
        return to_device(slots)

    def _output(self, seq: Sequence, old: int | None = None) -> RequestOutput:
        """The sample's RequestOutput; with a tokenizer, its text, cut at a stop string (which
        finishes it)."""
        old = len(seq.output) if old is None else old
        if self.tokenizer is None:
            return request_output(seq, old)
        text, new_text, stopped = sequence_text(self.tokenizer, seq)
        if stopped:
            self.scheduler.free(seq)
        return request_output(seq, old, text, new_text)
