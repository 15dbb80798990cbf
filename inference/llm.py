"""The text-level front: load a trained run, generate or stream text from text prompts.

    llm = LLM.from_checkpoint("runs/shakespeare-char")
    outputs = llm.generate(["Romeo.\n"], SamplingParams(temperature=0.8, max_new_tokens=200))
    print(outputs[0].text)
    for delta in llm.stream(["Romeo.\n"], SamplingParams(max_new_tokens=200)):
        print(delta.text, end="", flush=True)

Both run on `inference.Engine` (continuous batching over a paged KV cache): every prompt
is added as a request, and the engine steps until all have finished, so streamed deltas
join to exactly the generated text. Between chunks each running sample is decoded and
searched for its stop strings; one that contains a stop string is cut before it (finish
reason "stop") and leaves the batch. A delta only carries text that is final: a byte-level
tokenizer's incomplete UTF-8 character (decoded as U+FFFD) is held back until its last byte
arrives, and a tail that could still grow into a stop string is held back until it cannot.

`llm.chat([[{"role": "user", "content": "Hi"}]])` renders each conversation with the LLM's
chat template (`inference.chat`) and generates as `generate` does, stopping at the
template's end-of-turn token, which is not in the text. Its finish reason is then "stop",
as vLLM's `LLM.chat` and every OpenAI-compatible server (ours included) report it; `generate`
keeps "eos" for an EOS or stop token id, telling it apart from a stop string. The
conversation is encoded without the tokenizer's own special tokens (the template writes
them, as transformers' `apply_chat_template` encodes it: no second BOS).

Text does not stop at the model's context: a request whose `context_overflow` is None runs
as "crop" here (nanoGPT's sampler: past max_seq_len each token is predicted from the last
max_seq_len tokens; a longer prompt is cropped to them), unlike `generate` and the
`Engine`, where None means "error".
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax.numpy as jnp

from gpt_jax import checkpoint, tensor_parallel
from gpt_jax.params import inference_params
from inference import compile_cache as compile_cache_module
from inference import exported
from inference.chat import HOW_TO_SUPPLY, ChatTemplate, NoChatTemplate, token_ids
from inference.draft import check_draft
from inference.engine import Engine
from inference.generation import validate
from inference.sampling_params import SamplingParams
from inference.validation import encode_text


@dataclasses.dataclass
class TextCompletion:
    text: str  # generated text, cut before a stop string, without an ending EOS token's text
    tokens: list[int]  # generated ids, through the EOS or the token that completed a stop string
    finish_reason: str  # "eos", "stop" or "length" (`chat`: "stop" for an end-of-turn/EOS id)
    seed: int  # pass it back in SamplingParams to repeat the sample
    logprobs: list[float] | None = None  # per token of `tokens`, when asked
    top_logprobs: list[dict[int, float]] | None = None  # the `logprobs` most likely per step


@dataclasses.dataclass(frozen=True)
class Delta:
    """New text of one completion, as streamed."""

    index: int  # which completion: prompts in order, the n samples of each consecutively
    text: str  # text since this completion's previous delta (may be empty on the last one)
    completion: TextCompletion | None = None  # set on the completion's last delta


DTYPES = ("float32", "bfloat16")


def per_request(sampling, change):
    """`sampling` (None, one SamplingParams or a list) with `change` applied to each
    request's SamplingParams (None taken as the default one)."""
    def one(sp):
        sp = SamplingParams() if sp is None else sp
        return change(sp) if isinstance(sp, SamplingParams) else sp  # else: validate names it

    if sampling is None or isinstance(sampling, SamplingParams):
        return one(sampling)
    if not isinstance(sampling, (list, tuple)):
        return sampling  # validate names its type (a dict's keys are no SamplingParams)
    return [one(sp) for sp in sampling]


def crop_by_default(sampling):
    """`sampling` with every `context_overflow` of None made "crop", the LLM's default."""
    return per_request(sampling, lambda sp: sp if sp.context_overflow is not None else
                       dataclasses.replace(sp, context_overflow="crop"))


def with_stop_ids(sampling, stop_ids: list[int]):
    """`sampling` with `stop_ids` added to every request's stop_token_ids."""
    return per_request(sampling, lambda sp: dataclasses.replace(sp, stop_token_ids=tuple(
        sp.stop_token_ids) + tuple(i for i in stop_ids if i not in sp.stop_token_ids)))


class LLM:
    """A model, its config and tokenizer, generating text.

    `dtype="bfloat16"` (or `jnp.bfloat16`) stores the weights and the KV cache in bfloat16
    (half the bytes a memory-bound decode step reads); LayerNorm, softmax, attention
    accumulators and logits stay float32 inside the model.
    `quantize="int8"` quantizes the weights once, here: weight-only int8 with a float32
    scale per output channel (`gpt_jax.params.quantize`; embeddings and the tied output
    projection included, LayerNorm and biases float32), a quarter of float32's weight bytes
    per decode step; activations and logits stay float32, and `dtype` is then the KV
    cache's alone.
    `params` are kept in the decode layout (`gpt_jax.params.decode_layout`) or quantized,
    made once here (`gpt_jax.params.inference_params`).
    `chat_template` (a `ChatTemplate` or Jinja text) is what `chat` renders conversations
    with. `eos_token_ids` (a Hugging Face directory's, `from_pretrained`) end every
    generation that samples one (finish reason "eos"), beside each request's own.
    `mesh` (a `jax.sharding.Mesh` with a "model" axis) runs its engines tensor-parallel
    over it (`inference.Engine`, `gpt_jax.tensor_parallel`).
    `compile_cache` (default on) keeps the compiled programs on disk for the next process
    (`inference.compile_cache.enable`).
    `draft`: `(params, config)` or `(params, config, tokenizer)` of a draft model for
    `speculative="draft"` requests (`inference.draft`; its tokenizer, when given, must be
    the LLM's).

    Raises:
      ValueError: a dtype other than `DTYPES`, a quantize other than None or
        `gpt_jax.params.QUANTIZE`, params whose shapes do not match `config`
        (`gpt_jax.params.check_params`), or a mesh they do not fit, or a draft that cannot
        draft for the model (`inference.draft.check_draft`).
    """

    def __init__(self, params, config, tokenizer, dtype="float32", quantize: str | None = None,
                 chat_template: ChatTemplate | str | None = None,
                 eos_token_ids: tuple[int, ...] = (), mesh=None,
                 compile_cache: bool = True, draft=None):
        # before the first compile (inference_params'); the engines' programs exported there
        self.compile_dir = compile_cache_module.enable() if compile_cache else None
        try:
            name = jnp.dtype(dtype).name  # "bfloat16" and jnp.bfloat16 alike
        except TypeError:
            name = dtype
        if name not in DTYPES:
            raise ValueError(f"LLM dtype must be one of {DTYPES}, got {dtype!r}")
        self.cache_dtype = jnp.dtype(name)
        # The decode layout (and quantization) once, here: inside each compiled call it
        # would copy every weight.
        self.params = inference_params(params, config, self.cache_dtype, quantize,
                                       panels=mesh is None)
        self.quantize = quantize
        self.config, self.tokenizer = config, tokenizer
        self.chat_template = (ChatTemplate(chat_template) if isinstance(chat_template, str)
                              else chat_template)
        self.eos_token_ids = tuple(eos_token_ids)
        self.mesh = mesh
        tensor_parallel.check_mesh(mesh, config)
        if draft is not None:  # (params, config) or (params, config, tokenizer)
            check_draft(config, draft[1], tokenizer, draft[2] if len(draft) > 2 else None)
        self.draft = None if draft is None else tuple(draft[:2])
        self._engines: dict[int, Engine] = {}  # by max_slots

    def engine(self, max_slots: int) -> Engine:
        """The LLM's Engine with `max_slots` decode slots (made once, then reused)."""
        if max_slots not in self._engines:
            self._engines[max_slots] = Engine(
                self.params, self.config, self.tokenizer, max_slots=max_slots,
                cache_dtype=self.cache_dtype, quantize=self.quantize, mesh=self.mesh,
                draft=self.draft)
            if self.compile_dir is not None and self.mesh is None:  # artifacts are one-device programs
                exported.attach(self._engines[max_slots], self.compile_dir / "exported")
        return self._engines[max_slots]

    @classmethod
    def from_checkpoint(cls, run_dir, step: int | None = None, dtype="float32",
                        quantize: str | None = None, chat_template=None, mesh=None,
                        compile_cache: bool = True, draft=None) -> LLM:
        """Load the latest (or given) checkpoint of a training run directory (see `LLM` for
        `dtype`, `quantize`, `mesh`, `compile_cache` and `draft`). `chat_template`: a template
        file; None takes the run directory's, if it has one (`ChatTemplate.load`)."""
        config, params, tokenizer = checkpoint.load_params(run_dir, step)
        template = ChatTemplate.load(run_dir, chat_template)
        return cls(params, config, tokenizer, dtype, quantize, template, mesh=mesh,
                   compile_cache=compile_cache, draft=draft)

    @classmethod
    def from_pretrained(cls, hf_dir, dtype="float32", quantize: str | None = None,
                        chat_template=None, mesh=None, compile_cache: bool = True,
                        draft=None) -> LLM:
        """Load a Hugging Face directory of any family `gpt_jax.load_hf` reads, with its
        tokenizer (`gpt_jax.hf.load_hf_tokenizer`; None when it has none: token-id prompts
        only), every EOS id of config.json and generation_config.json, and its chat template
        unless `chat_template` names a template file (`ChatTemplate.load`: with the
        directory's special tokens)."""
        from gpt_jax.hf import load_hf, load_hf_eos_token_ids, load_hf_tokenizer

        config, params = load_hf(hf_dir)
        template = ChatTemplate.load(hf_dir, chat_template)
        return cls(params, config, load_hf_tokenizer(hf_dir), dtype, quantize, template,
                   load_hf_eos_token_ids(hf_dir), mesh=mesh, compile_cache=compile_cache,
                   draft=draft)

    def _encode(self, prompts) -> list[list[int]]:
        """Token ids of each text prompt (`encode_text`: "" is [BOS] with a tokenizer that
        adds one). Raises TypeError for a bare string (which would otherwise be taken as one
        prompt per character) or a non-string prompt; RequestError for a prompt of no
        tokens."""
        if isinstance(prompts, (str, bytes)):
            raise TypeError(f"prompts must be a list of strings, got a bare string {prompts!r:.40}"
                            "; wrap it in a list")
        bad = [p for p in prompts if not isinstance(p, str)]
        if bad:
            raise TypeError(f"prompts must be strings, got {type(bad[0]).__name__}")
        return [encode_text(self.tokenizer, p, i) for i, p in enumerate(prompts)]

    def generate(self, prompts: list[str], sampling=None, *, max_batch_size: int = 32,
                 progress: bool = True) -> list[TextCompletion]:
        """Generate for each text prompt: one TextCompletion per prompt and sample, in order.

        Any number of prompts: they go to the engine together and at most `max_batch_size`
        samples decode at once (the engine's slots; a sample that finishes frees its slot
        for the next at once), behind a tqdm progress bar over completions.

        Args:
          sampling: one SamplingParams for all prompts or one per prompt.
          max_batch_size: most samples decoded at once, >= 1.
          progress: show the progress bar (stderr).
        Raises:
          ValueError: `max_batch_size` < 1, a prompt character outside the tokenizer's
            vocabulary, an empty prompt when the tokenizer adds no BOS, or any invalid
            request (see `inference.generation.validate`), before anything runs.
        """
        deltas = self.stream(prompts, sampling, max_batch_size=max_batch_size)
        return _collect(deltas, sampling, len(prompts), progress, "generate")

    def stream(self, prompts: list[str], sampling=None, *,
               max_batch_size: int = 32) -> Iterator[Delta]:
        """Yield text deltas per completion as the engine's chunks of decode steps finish;
        the last delta of each completion carries its TextCompletion. Joined, a
        completion's deltas equal its `generate` text. Raises as `generate`, when called
        (not at the first delta)."""
        _check_batch_size(max_batch_size)
        return self._stream(self._encode(prompts), sampling, max_batch_size)

    def chat(self, conversations: list[list[dict]], sampling=None, *,
             max_batch_size: int = 32, progress: bool = True) -> list[TextCompletion]:
        """`generate` for each conversation (a list of {"role", "content"} messages),
        rendered with the chat template and stopping at its end-of-turn tokens (finish
        reason "stop"). Raises as `generate`; NoChatTemplate without a template;
        RequestError (field "messages") for messages the template refuses."""
        deltas = self.stream_chat(conversations, sampling, max_batch_size=max_batch_size)
        return _collect(deltas, sampling, len(conversations), progress, "chat")

    def stream_chat(self, conversations: list[list[dict]], sampling=None, *,
                    max_batch_size: int = 32) -> Iterator[Delta]:
        """`stream` for each conversation, as `chat` renders it."""
        _check_batch_size(max_batch_size)
        prompts, sampling = self._chat_prompts(conversations, sampling)
        return self._stream(prompts, sampling, max_batch_size, chat=True)

    def _chat_prompts(self, conversations, sampling) -> tuple[list[list[int]], object]:
        """The prompt ids of each conversation (`ChatTemplate.encode`), and `sampling` with
        the template's end-of-turn ids among each request's stop_token_ids."""
        if self.chat_template is None:
            raise NoChatTemplate(f"this LLM has no chat template; {HOW_TO_SUPPLY}")
        if not isinstance(conversations, (list, tuple)) or (
                conversations and isinstance(conversations[0], dict)):
            raise TypeError("conversations must be a list of conversations (each a list of "
                            "messages); wrap a single conversation in a list")
        prompts = [self.chat_template.encode(self.tokenizer, c) for c in conversations]
        stop_ids = token_ids(self.tokenizer, self.chat_template.end_of_turn_tokens())
        return prompts, with_stop_ids(sampling, stop_ids)

    def _stream(self, token_prompts, sampling, max_batch_size: int,
                chat: bool = False) -> Iterator[Delta]:
        """`stream` of token-id prompts (checked by `validate` here, when called)."""
        sampling = crop_by_default(sampling)
        if self.eos_token_ids:  # else the requests go to validate untouched
            sampling = with_stop_ids(sampling, list(self.eos_token_ids))
        token_prompts, per_prompt = validate(self.config, token_prompts, sampling,
                                              tokenizer=self.tokenizer)
        return self._deltas(token_prompts, per_prompt, max_batch_size, chat)

    def _deltas(self, token_prompts, per_prompt, max_batch_size: int,
                chat: bool) -> Iterator[Delta]:
        """The engine's outputs for validated requests, as `stream` yields them (a chat's
        end-of-turn or EOS token: finish reason "stop")."""
        eng = self.engine(max_batch_size)
        first, ids = [], []  # completion index of each prompt's sample 0; request ids
        for p, (tokens, sp) in enumerate(zip(token_prompts, per_prompt)):
            first.append(sum(s.n for s in per_prompt[:p]))
            ids.append(f"llm-{id(self)}-{p}-{eng.arrivals}")
            eng.add_request(ids[-1], tokens, sp)
        index = {request_id: k for k, request_id in enumerate(ids)}
        try:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.request_id not in index:
                        continue
                    i = first[index[out.request_id]] + out.sample_index
                    completion = None
                    if out.finished:
                        reason = "stop" if chat and out.finish_reason == "eos" else \
                            out.finish_reason
                        completion = TextCompletion(out.text, out.token_ids, reason, out.seed,
                                                    out.logprobs, out.top_logprobs)
                    if out.new_text or completion:
                        yield Delta(i, out.new_text, completion)
        finally:  # a consumer that stops early leaves no request behind
            for request_id in ids:
                if request_id in eng.scheduler.requests:
                    eng.abort(request_id)


def _check_batch_size(max_batch_size) -> None:
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")


def _collect(deltas: Iterator[Delta], sampling, n_prompts: int, progress: bool,
             desc: str) -> list[TextCompletion]:
    """Every completion of `deltas`, in order, behind a tqdm bar (stderr) when `progress`."""
    from tqdm import tqdm

    per_prompt = sampling if isinstance(sampling, (list, tuple)) else \
        [sampling or SamplingParams()] * n_prompts
    done = {}
    with tqdm(total=sum(sp.n for sp in per_prompt), disable=not progress,
              unit="completion", desc=desc) as bar:
        for d in deltas:
            if d.completion:
                done[d.index] = d.completion
                bar.update()
    return [done[i] for i in range(len(done))]
