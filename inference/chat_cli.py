"""`gpt-jax chat`: talk with a model in the terminal, through its chat template.

Usage:
  gpt-jax chat --hf-checkpoint SmolLM2-135M-Instruct
  gpt-jax chat --run-dir runs/shakespeare-char --chat-template plain.jinja --temperature 0.7

A run directory has no chat template of its own: write one, e.g. a plain.jinja holding
  {% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}assistant:

Each reply is printed as it decodes. The whole conversation is the prompt of every turn,
and one engine serves them all, so the full pages of the previous turn's prompt are found
in its prefix cache: only the rest (the last reply, the new message) is prefilled. After
each reply one line says so (prompt tokens, how many came from the prefix cache, how many
were prefilled), with the time to its first text, its length and the finish reason.
A conversation that outgrows the model's context drops its oldest exchanges (a user message
and its reply), the system message kept, and says so in one line on stderr, as Ollama
truncates a chat's messages to its context and llama.cpp logs its context shift. A reply
gets at most the tokens the context leaves and stops there with finish reason "length",
which its line says (vLLM's default max_tokens; llama.cpp's server without context shift);
a message that alone leaves no room for a reply is refused, naming both lengths, the
conversation kept. `--context-overflow crop` (`/set context_overflow crop`) instead crops
such a message and lets a reply go past the context, each token predicted from the last
max_seq_len (nanoGPT's window), its line saying so.

At the `>` prompt:
  /reset         forget the conversation (the system message stays)
  /system TEXT   set the system message (empty TEXT: none)
  /set F VALUE   set SamplingParams field F of the next replies (/set temperature 0.7)
  /stats         the engine's counters (pages, prefix cache hits, prefilled tokens)
  /help          this list
Ctrl-C during a reply stops it; what was said so far stays in the conversation, as
llama.cpp's interactive mode keeps it. Ctrl-C at the prompt clears the line; Ctrl-D leaves
(exit status 0). Every SamplingParams flag of `gpt-jax generate` applies to each reply.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
import time

from inference.chat import HOW_TO_SUPPLY
from inference.draft_engine import add_draft_args, read_draft
from inference.sampling_flags import add_sampling_args, refusal, sampling_from_args
from inference.llm import LLM
from inference.load import add_model_args
from inference.sampling_params import SamplingParams

COMMANDS = ("/reset", "/system", "/set", "/stats", "/help")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpt-jax chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a Jinja chat template (default: the model directory's "
                        "chat_template.jinja or tokenizer_config.json's)")
    p.add_argument("--system", default=None, help="the system message to start with")
    add_sampling_args(p)
    p.set_defaults(context_overflow="error")  # a reply stops at the context (module doc)
    add_draft_args(p)
    return p.parse_args(argv)


class ContextFull(ValueError):
    """A message that alone leaves no room for a reply in the model's context."""


@dataclasses.dataclass
class Chat:
    """A conversation with `llm`: its system message and turns so far."""

    llm: LLM
    sampling: SamplingParams  # of every reply
    system: str | None = None
    turns: list[dict] = dataclasses.field(default_factory=list)  # user, assistant, ...

    def messages(self, user: str) -> list[dict]:
        """The conversation with `user` said next."""
        return self._with(self.turns, user)

    def fit_context(self, user: str, err) -> int:
        """The prompt length (tokens) with `user` said next, once the oldest exchanges are
        dropped until it leaves room for a reply token (`drop_oldest_exchanges`), saying so
        on `err` in one line. A message that alone (with the system message) leaves no room
        is refused (`ContextFull`, nothing dropped), or under "crop" cropped to its last
        max_seq_len tokens, which `err` is told. Raises as `ChatTemplate.encode`."""
        llm, limit = self.llm, self.llm.config.max_seq_len
        length = lambda turns: len(llm.chat_template.encode(  # noqa: E731
            llm.tokenizer, self._with(turns, user)))
        crop = self.sampling.overflow("error") == "crop"
        alone = length([])
        if alone >= limit and not crop:
            raise ContextFull(
                f"this message makes a prompt of {alone} tokens"
                f"{' with the system message' if self.system else ''}, and the model's "
                f"context is {limit} tokens (max_seq_len): no room for a reply, so it was "
                "not sent; shorten it (or /set context_overflow crop to keep its last "
                f"{limit} tokens)")
        before = length(self.turns)
        if before < limit:
            return before
        kept = drop_oldest_exchanges(self.turns, length, limit - 1)
        after = length(kept)
        if kept != self.turns:
            dropped = (len(self.turns) - len(kept)) // 2
            print(f"gpt-jax chat: the conversation outgrew the context ({before} tokens > "
                  f"max_seq_len {limit}): dropped the oldest {dropped} exchange"
                  f"{'s' * (dropped != 1)} ({before - after} tokens"
                  f"{'; the system message stays' if self.system else ''})", file=err,
                  flush=True)
            self.turns = kept
        if after > limit:  # under "crop" only
            print(f"gpt-jax chat: this message makes a prompt of {after} tokens, past "
                  f"max_seq_len {limit}: its first {after - limit} tokens are cropped",
                  file=err, flush=True)
        return min(after, limit)

    def reply_sampling(self, prompt_length: int) -> SamplingParams:
        """The sampling of a reply to a prompt of `prompt_length` tokens: under "error" (the
        chat's default) at most the tokens the context leaves (`min_tokens` too), so that
        a reply reaching the context ends with finish reason "length"; "crop" as set."""
        overflow = self.sampling.overflow("error")
        if overflow == "crop":
            return dataclasses.replace(self.sampling, context_overflow=overflow)
        room = min(self.sampling.max_new_tokens, self.llm.config.max_seq_len - prompt_length)
        return dataclasses.replace(self.sampling, context_overflow=overflow,
                                   max_new_tokens=room,
                                   min_tokens=min(self.sampling.min_tokens, room))

    def _with(self, turns: list[dict], user: str) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + turns + [{"role": "user", "content": user}]

    def reply(self, user: str, out, err=sys.stderr) -> str:
        """Stream the reply to `user` to `out`, keep both in the conversation, and return
        the turn's summary line; first fit the conversation to the context (`fit_context`,
        its line on `err`). Ctrl-C (SIGINT) stops the reply at its next piece of text and
        keeps what was said. Raises ContextFull (`fit_context`), or as `LLM.stream_chat`
        (before anything is printed: the conversation is then left as it was, less the
        exchanges dropped)."""
        prompt_length = self.fit_context(user, err)
        engine = self.llm.engine(1)  # one slot, the same engine every turn
        before = engine.stats()
        deltas = self.llm.stream_chat([self.messages(user)], self.reply_sampling(prompt_length),
                                      max_batch_size=1)
        stop = threading.Event()
        previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
        start, first, said, done = time.monotonic(), None, "", None
        try:
            for delta in deltas:
                if first is None and delta.text:  # not an empty last piece
                    first = time.monotonic()
                said += delta.text
                out.write(delta.text)
                out.flush()
                done = delta.completion
                if stop.is_set():
                    break
        finally:
            deltas.close()  # an unfinished reply's request is aborted, its pages freed
            signal.signal(signal.SIGINT, previous)
        self.turns += [{"role": "user", "content": user},
                       {"role": "assistant", "content": said}]
        note = _context_note(self.sampling.overflow("error"), prompt_length, done,
                             self.llm.config.max_seq_len)
        return _summary(engine.page_size, before, engine.stats(), start, first, done, note)


def drop_oldest_exchanges(turns: list[dict], length, limit: int) -> list[dict]:
    """`turns` (user, assistant, user, ...) less its oldest exchanges, a user message and
    its reply at a time (so roles still alternate), until `length(turns)` (the prompt's
    tokens) is at most `limit`; none left when even that is past it."""
    while turns and length(turns) > limit:
        turns = turns[2:]
    return turns


def _context_note(overflow: str, prompt_length: int, done, limit: int) -> str:
    """What the summary adds after the finish reason of a reply (`done`, a TextCompletion or
    None) to a prompt of `prompt_length` tokens that reached the context (`limit` tokens):
    under "error" that it is full, under "crop" that the reply went past it."""
    if done is None:
        return ""
    total = prompt_length + len(done.tokens)
    if overflow == "crop":
        return (f": past max_seq_len {limit}, each token was predicted from the last {limit}"
                if total > limit else "")
    return f": the context (max_seq_len {limit}) is full" if \
        done.finish_reason == "length" and total >= limit else ""


def _summary(page_size: int, before: dict, after: dict, start: float, first: float | None,
             done, note: str = "") -> str:
    """One line on a turn: its prompt tokens, from the prefix cache and prefilled (engine
    counters before and after), when its first text came (the engine hands text over by
    chunks of decode steps), its length and finish reason ("interrupted": Ctrl-C), then
    `note` (`_context_note`)."""
    reused = (after["prefix_cache_hits"] - before["prefix_cache_hits"]) * page_size
    prefilled = after["prefilled_tokens"] - before["prefilled_tokens"]
    line = (f"[prompt {reused + prefilled} tokens: {reused} from the prefix cache, "
            f"{prefilled} prefilled")
    if first is not None:
        line += f"; first text after {first - start:.2f} s"
    if done is None:
        return line + "; interrupted]"
    return line + (f"; {len(done.tokens)} tokens in {time.monotonic() - start:.2f} s; "
                   f"{done.finish_reason}{note}]")


def command(chat: Chat, line: str) -> str:
    """Run a /command; what to print."""
    name, _, rest = line.partition(" ")
    if name == "/reset":
        chat.turns = []
        return "(conversation cleared)"
    if name == "/system":
        chat.system = rest.strip() or None
        return f"(system message {'set' if chat.system else 'cleared'})"
    if name == "/set":
        field, _, value = rest.strip().partition(" ")
        fields = [f.name for f in dataclasses.fields(SamplingParams)]
        if field not in fields:
            return (f"/set: unknown field {field!r}; allowed: {', '.join(fields)} "
                    "(/set FIELD VALUE)")
        try:  # a JSON value: 0.7, 200, null, ["a"]; else the word itself: crop
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        try:
            sampling = dataclasses.replace(chat.sampling, **{field: parsed})
            refuse_for_chat(sampling, sampling.speculative != "draft"
                            or chat.llm.draft is not None, "")
        except (TypeError, ValueError) as error:
            return f"/set {rest.strip()}: {error} (/set FIELD VALUE, a SamplingParams field)"
        chat.sampling = sampling
        return f"({field} = {value})"
    if name == "/stats":
        return " ".join(f"{k}={v}" for k, v in chat.llm.engine(1).stats().items())
    if name == "/help":
        return __doc__[__doc__.index("At the"):__doc__.index("Ctrl-C during")].rstrip()
    return f"unknown command {name!r}; commands: {', '.join(COMMANDS)}"


def refuse_for_chat(sampling: SamplingParams, has_draft: bool, prefix: str) -> None:
    """Raise ValueError (fields named with `prefix`: "--" for flags) for what a chat cannot
    do: several replies or logprobs (a reply is one text), or speculative="draft" without
    a draft model (`has_draft` False)."""
    if sampling.n != 1 or sampling.logprobs is not None:
        raise ValueError(f"{prefix}n and {prefix}logprobs do not apply to a chat (one reply, "
                         f"as text); allowed: n 1, logprobs null")
    if sampling.speculative == "draft" and not has_draft:
        raise ValueError("speculative='draft' needs a draft model; allowed: null or 'ngram' "
                         "here (a draft: gpt-jax chat --draft-run-dir DIR or "
                         "--draft-hf-checkpoint DIR)")


def load(args) -> LLM:
    """The model `args` name with its chat template. Raises SystemExit in one line: a model
    that cannot load, no template, a bad flag."""
    try:
        refuse_for_chat(sampling_from_args(args), True, "--")  # the draft: LLM checks it
        draft = read_draft(args)  # --speculative draft's model, checked by LLM
        llm = (LLM.from_pretrained(args.hf_checkpoint, args.dtype, args.quantize,
                                   args.chat_template, draft=draft) if args.hf_checkpoint else
               LLM.from_checkpoint(args.run_dir, None, args.dtype, args.quantize,
                                   args.chat_template, draft=draft))
    except (OSError, ValueError) as error:
        raise refusal(error, "chat") from None
    if llm.chat_template is None:
        raise SystemExit(f"gpt-jax chat: {args.hf_checkpoint or args.run_dir} has no chat "
                         f"template; {HOW_TO_SUPPLY.replace('gpt-jax serve', 'gpt-jax chat')}")
    if llm.tokenizer is None:
        raise SystemExit(f"gpt-jax chat: {args.hf_checkpoint} has no tokenizer")
    return llm


def main(argv=None) -> int:
    """The chat loop; 0 at Ctrl-D."""
    args = parse_args(argv)
    chat = Chat(load(args), sampling_from_args(args), args.system)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    print(f"gpt-jax chat: {args.hf_checkpoint or args.run_dir}; /help for commands, "
          "Ctrl-C stops a reply, Ctrl-D leaves", flush=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            print(command(chat, line.strip()), flush=True)
            continue
        try:
            summary = chat.reply(line, sys.stdout)
        except ValueError as error:  # a template refusing the conversation, text a
            print(f"gpt-jax chat: {error}", file=sys.stderr, flush=True)  # char vocab lacks
            continue
        print(f"\n{summary}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
