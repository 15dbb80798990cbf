"""The sampling flags of the commands that generate (`gpt-jax generate`, `gpt-jax chat`): a
flag for every `SamplingParams` field, and the SamplingParams they give."""

from __future__ import annotations

import argparse

from inference.errors import RequestError
from inference.sampling_params import CONTEXT_OVERFLOW, SamplingParams

DEFAULT_MAX_NEW_TOKENS = 200
# SamplingParams field -> its flag, for the errors (`refusal`): every field has one.
FIELD_FLAGS = {
    "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty", "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty", "seed": "--seed",
    "max_new_tokens": "--max-new-tokens", "stop_token_ids": "--stop-token-id", "stop": "--stop",
    "stop_sequences": "--stop-sequence", "logprobs": "--logprobs", "n": "--n",
    "min_tokens": "--min-tokens", "logit_bias": "--logit-bias",
    "context_overflow": "--context-overflow", "json_schema": "--json-schema",
    "regex": "--regex", "choice": "--choice", "json_object": "--json-object",
    "speculative": "--speculative", "num_speculative_tokens": "--num-speculative-tokens",
    "prompt_lookup_min": "--prompt-lookup-min", "prompt_lookup_max": "--prompt-lookup-max",
}
# The fields that only speculative decoding reads: their flags need --speculative.
SPECULATIVE_ONLY = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
# The draft model's flags (`inference.draft_engine.add_draft_args`) -> their args attribute:
# they need --speculative draft, and it needs one of them.
DRAFT_FLAGS = {"--draft-run-dir": "draft_run_dir", "--draft-hf-checkpoint": "draft_hf_checkpoint"}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """A flag for every SamplingParams field (`sampling_from_args` reads them)."""
    s = p.add_argument_group("sampling (inference.SamplingParams)")
    s.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"default: {DEFAULT_MAX_NEW_TOKENS} (with --context-overflow error: "
                        "or what the model's context leaves after the longest prompt if that "
                        "is less)")
    s.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    s.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    s.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    s.add_argument("--presence-penalty", type=float, default=0.0, help="0 = off")
    s.add_argument("--frequency-penalty", type=float, default=0.0, help="0 = off")
    s.add_argument("--seed", type=int, default=None, help="default: a fresh random seed")
    s.add_argument("--stop-token-id", type=int, action="append", default=[],
                   help="EOS token id (repeatable)")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--stop-sequence", type=ids_arg, action="append", default=[],
                   help="token stop sequence, comma-separated ids (repeatable)")
    s.add_argument("--logprobs", type=int, default=None, help="top-N alternatives per token")
    s.add_argument("--n", type=int, default=1, help="samples per prompt")
    s.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="no EOS, stop sequence or stop string before N tokens (vLLM)")
    s.add_argument("--logit-bias", type=bias_arg, action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS in [-100, 100] to token ID's logit (OpenAI; repeatable)")
    s.add_argument("--json-schema", metavar="JSON", help="structured output: the text is JSON "
                   "valid under this JSON schema (given as JSON text)")
    s.add_argument("--regex", help="structured output: the text matches this regex")
    s.add_argument("--choice", action="append", metavar="TEXT",
                   help="structured output: the text is one of these (repeatable)")
    s.add_argument("--json-object", action="store_true",
                   help="structured output: the text is a JSON object")
    s.add_argument("--speculative", choices=["ngram", "draft"], default=None,
                   help="speculative decoding: ngram = prompt lookup, draft = a draft model "
                        "(--draft-run-dir or --draft-hf-checkpoint) (default: off)")
    s.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens drafted per step with --speculative (default: "
                        f"{SamplingParams.num_speculative_tokens})")
    s.add_argument("--prompt-lookup-min", type=int, default=None, metavar="N",
                   help="shortest n-gram matched with --speculative ngram (default: "
                        f"{SamplingParams.prompt_lookup_min})")
    s.add_argument("--prompt-lookup-max", type=int, default=None, metavar="N",
                   help="longest n-gram matched with --speculative ngram (default: "
                        f"{SamplingParams.prompt_lookup_max})")
    s.add_argument("--context-overflow", choices=CONTEXT_OVERFLOW, default="crop",
                   help="past the model's context: crop = predict each token from the last "
                        "max_seq_len tokens (nanoGPT; a longer prompt is cropped), error = "
                        "refuse the request")


def ids_arg(text: str) -> tuple[int, ...]:
    """Comma-separated token ids. Raises argparse.ArgumentTypeError naming the text."""
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids such as 1,2,3, got {text!r}") from None


def bias_arg(text: str) -> tuple[int, float]:
    """`ID=BIAS`, a token id and its logit bias. Raises argparse.ArgumentTypeError naming the
    text."""
    token_id, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token_id), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected ID=BIAS such as 50256=-100, got {text!r}") from None


def speculative_settings(args) -> dict:
    """The speculative-only fields the flags give, the others at SamplingParams' defaults.

    Raises:
      ValueError: naming the first such flag given without --speculative, or a draft model
        flag (--draft-run-dir, --draft-hf-checkpoint: `inference.draft_engine.add_draft_args`,
        where the command has them) without --speculative draft (either would be ignored),
        or --speculative draft without a draft model flag.
    """
    given = {f: getattr(args, f) for f in SPECULATIVE_ONLY if getattr(args, f) is not None}
    if given and args.speculative is None:
        field, value = next(iter(given.items()))
        raise ValueError(f"{FIELD_FLAGS[field]} {value} applies only to speculative decoding; "
                         "add --speculative ngram, or leave it out")
    drafts = {flag: getattr(args, name, None) for flag, name in DRAFT_FLAGS.items()}
    given_drafts = {flag: value for flag, value in drafts.items() if value is not None}
    if given_drafts and args.speculative != "draft":
        flag, value = next(iter(given_drafts.items()))
        raise ValueError(f"{flag} {value} applies only to --speculative draft; add "
                         "--speculative draft, or leave it out")
    if args.speculative == "draft" and not given_drafts:
        raise ValueError("--speculative draft needs a draft model: add --draft-run-dir DIR or "
                         "--draft-hf-checkpoint DIR (same tokenizer as the model)")
    return {f: given.get(f, getattr(SamplingParams, f)) for f in SPECULATIVE_ONLY}


def sampling_from_args(args) -> SamplingParams:
    """SamplingParams from the parsed flags. Raises ValueError for an out-of-range value, or
    a speculative-only flag without --speculative (`speculative_settings`)."""
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed,
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS if args.max_new_tokens is None
        else args.max_new_tokens, stop_token_ids=args.stop_token_id,
        stop=[s.replace("\\n", "\n") for s in args.stop], stop_sequences=args.stop_sequence,
        logprobs=args.logprobs, n=args.n, min_tokens=args.min_tokens,
        logit_bias=args.logit_bias, context_overflow=args.context_overflow,
        json_schema=args.json_schema, regex=args.regex, choice=args.choice,
        json_object=args.json_object, speculative=args.speculative,
        **speculative_settings(args),
    )


def refusal(error: Exception, command: str = "generate") -> SystemExit:
    """`gpt-jax COMMAND`'s one-line error for `error`, in flags: `SamplingParams.top_p=2.0` is
    `--top-p=2.0`, another field it mentions (`max_new_tokens`) is its flag too, and a hint to
    set context_overflow "crop" is `--context-overflow crop`."""
    if not isinstance(error, RequestError):
        return SystemExit(f"gpt-jax {command}: {error}")
    setting = error.hint and FIELD_FLAGS[error.hint.field] + " {value}"  # as its flag
    text = error.message(FIELD_FLAGS.get(error.field, error.field), FIELD_FLAGS,
                         setting=setting)
    return SystemExit(f"gpt-jax {command}: {text}")
