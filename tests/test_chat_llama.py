"""Chat with a Llama-style model from a Hugging Face directory, end to end: a small random
Llama (save_hf) beside a Llama 3 tokenizer whose tokenizer.json adds <|begin_of_text|>
itself, Llama 3's chat template, and generation_config.json's EOS list (<|end_of_text|>,
<|eom_id|>, <|eot_id|>, as Llama 3.1 Instruct ships it).

The rendered template already starts with `bos_token`: our prompt ids equal
`transformers`' `apply_chat_template(..., tokenize=True)` (one BOS, not two). Then
the server `gpt-jax serve --hf-checkpoint DIR` runs answers chat completions (streamed and
not, n = 2, seed, stop, logprobs) as `LLM.from_pretrained(DIR).chat` does, and each id of
the EOS list ends a reply with finish_reason "stop", absent from the text."""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from gpt_jax import GPTConfig, save_hf
from gpt_jax.tokenizer import BPETokenizer
from inference import LLM, SamplingParams
from inference.chat import token_ids
from test_chat import CONVERSATIONS, CORPUS, LLAMA3, TALK

BOS, END, EOM, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"
SPECIAL = [BOS, END, "<|start_header_id|>", "<|end_header_id|>", EOM, EOT]
SLOTS = 4  # the server's and LLM.chat's engine: the same programs
TIMEOUT_S = 120


def _tokenizer() -> BPETokenizer:
    """Byte-level BPE on the chat corpus with Llama 3's special tokens, and its BOS added by
    the post-processor, as Llama 3's tokenizer.json adds it."""
    from tokenizers import processors

    bpe = BPETokenizer.from_text(CORPUS, vocab_size=600, special_tokens=tuple(SPECIAL))
    bpe.tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    return bpe


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A Llama-style HF directory with a chat template (tokenizer_config.json's)."""
    from transformers import PreTrainedTokenizerFast

    from conftest import lively_params

    path = tmp_path_factory.mktemp("llama-chat")
    bpe = _tokenizer()
    config = GPTConfig.preset("tiny-llama", vocab_size=bpe.vocab_size, max_seq_len=256)
    save_hf(config, lively_params(config, seed=3, scale=3.0), path)
    PreTrainedTokenizerFast(tokenizer_object=bpe.tokenizer, bos_token=BOS, eos_token=EOT,
                            chat_template=LLAMA3).save_pretrained(path)
    ids = [bpe.tokenizer.token_to_id(t) for t in (END, EOM, EOT)]
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": ids}))
    return path


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def auto(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)


def auto_ids(auto, messages) -> list[int]:
    out = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_prompt_ids_have_one_bos_as_apply_chat_template(auto, llm):
    assert llm.tokenizer.encode("Hi")[0] == 0  # the tokenizer adds BOS to plain text
    assert llm.eos_token_ids == (1, 4, 5)
    # the template's end of turn is found as one id, not [BOS, id]
    assert token_ids(llm.tokenizer, llm.chat_template.end_of_turn_tokens()) == [5]
    for messages in CONVERSATIONS:
        text = llm.chat_template.render(messages)
        assert text.startswith(BOS) and llm.tokenizer.encode(text)[:2] == [0, 0]  # the trap
        ids = llm.chat_template.encode(llm.tokenizer, messages)
        assert ids == auto_ids(auto, messages) and ids.count(0) == 1


@pytest.fixture(scope="module")
def served(llama_dir, llm):
    """The server `gpt-jax serve --hf-checkpoint DIR --max-slots 4` runs (its loaders:
    the directory's template, EOS list and engine), in this process so that it shares the
    compiled programs of `llm`'s engine; yields its base URL."""
    from inference.serve import _chat_template, _engine, parse_args
    from inference.server import ServerConfig
    from live_server import running, wait_ready

    args = parse_args(["--hf-checkpoint", str(llama_dir), "--max-slots", str(SLOTS)])
    engine, eos = _engine(args, llama_dir)
    cfg = ServerConfig(llama_dir.name, eos_token_ids=eos,
                       chat_template=_chat_template(args.chat_template, llama_dir))
    with running(lambda: engine, cfg) as base:
        wait_ready(base)
        yield base


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0,
                         timeout=TIMEOUT_S)


def solo_chat(llm, messages, **fields):
    return llm.chat([messages], SamplingParams(**fields), max_batch_size=SLOTS, progress=False)


def test_served_chat_equals_llm_chat_streamed_and_not(llama_dir, llm, client, auto):
    fields = dict(max_new_tokens=24, temperature=0.9, seed=7, n=2, logprobs=2)
    texts = [r.text for r in solo_chat(llm, TALK, **fields)]
    stop = next(t[4:6] for t in texts if len(t) >= 8)  # a stop string one sample meets
    ref = solo_chat(llm, TALK, **fields, stop=[stop])
    assert {r.finish_reason for r in ref} <= {"stop", "length"}
    asked = dict(model=llama_dir.name, messages=TALK, max_completion_tokens=24,
                 temperature=0.9, seed=7, n=2, stop=stop)
    r = client.chat.completions.create(**asked, logprobs=True, top_logprobs=2)
    assert r.usage.prompt_tokens == len(auto_ids(auto, TALK))  # one BOS
    assert r.usage.completion_tokens == sum(len(e.tokens) for e in ref)
    assert any(c.finish_reason == "stop" for c in r.choices)
    for choice, expected in zip(r.choices, ref):
        assert choice.message.content == expected.text
        assert choice.finish_reason == expected.finish_reason
        np.testing.assert_allclose([c.logprob for c in choice.logprobs.content],
                                   expected.logprobs, atol=1e-5)
    chunks = list(client.chat.completions.create(**asked, stream=True))
    texts, finish = {0: "", 1: ""}, {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert [texts[0], texts[1]] == [e.text for e in ref]
    assert finish == {0: ref[0].finish_reason, 1: ref[1].finish_reason}


@pytest.mark.parametrize("token", [END, EOM, EOT])
def test_each_id_of_the_eos_list_ends_a_reply_with_stop(llama_dir, llm, client, token):
    """<|eot_id|> is the template's end of turn; <|end_of_text|> and <|eom_id|> come only
    from generation_config.json's list."""
    end = llm.tokenizer.tokenizer.token_to_id(token)
    out, = solo_chat(llm, TALK, max_new_tokens=20, min_tokens=2, logit_bias={end: 100.0},
                     temperature=0.0)
    assert out.finish_reason == "stop" and out.tokens[-1] == end and len(out.tokens) == 3
    assert out.text == llm.tokenizer.decode(out.tokens[:-1]) and token not in out.text
    r = client.chat.completions.create(model=llama_dir.name, messages=TALK, max_tokens=20,
                                       logit_bias={str(end): 100}, temperature=0,
                                       extra_body={"min_tokens": 2})
    choice, = r.choices
    assert choice.finish_reason == "stop" and r.usage.completion_tokens == 3
    assert choice.message.content == out.text


def test_an_empty_text_prompt_is_bos_alone_as_vllm_takes_it(llama_dir, llm, client,
                                                             monkeypatch):
    """Fault: "" was refused by /v1/completions and `gpt-jax generate` although this
    tokenizer adds BOS: vLLM takes it as the prompt [BOS]. Now the server, `LLM.generate`
    and the command take it so (test_llm: refused, by name, where no BOS is added)."""
    from inference import cli

    out, = llm.generate([""], SamplingParams(temperature=0.0, max_new_tokens=6),
                        max_batch_size=SLOTS, progress=False)
    assert len(out.tokens) == 6
    for prompt in ("", [0]):  # the text "", the token ids [BOS]
        r = client.completions.create(model=llama_dir.name, prompt=prompt, max_tokens=6,
                                      temperature=0)
        assert r.usage.prompt_tokens == 1 and r.choices[0].text == out.text
    seen = []
    monkeypatch.setattr(cli.LLM, "from_pretrained", lambda *args, **kwargs: llm)
    monkeypatch.setattr(cli, "print_stream", lambda *args: seen.append(args))
    cli.main(["--hf-checkpoint", str(llama_dir), "--prompt", "", "--temperature", "0"])
    (_, prompts, sampling), = seen
    assert prompts == [""] and sampling.temperature == 0.0


# ---------------------------------------------------------------------- gpt-jax chat

# Makes the pseudo-terminal the controlling terminal of the command (a new session), so
# that Ctrl-C typed into it is SIGINT to the command, as in a real terminal.
WITH_TTY = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
            "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
SUMMARY = r"\[prompt (\d+) tokens: (\d+) from the prefix cache, (\d+) prefilled[^\]]*\]"


class Terminal:
    """A command on a pseudo-terminal: type into it, read what it printed."""

    def __init__(self, argv: list[str]):
        import pty

        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WITH_TTY] + argv, stdin=slave, stdout=slave,
            stderr=slave, start_new_session=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        os.close(slave)
        self.seen = b""  # printed since the last match

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def expect(self, pattern: str, consume: bool = True) -> re.Match:
        """The first match of `pattern` in what was printed since the last match (without
        readline's bracketed-paste switches); it and what came before it are then consumed
        unless `consume` is False."""
        import select

        deadline = time.monotonic() + TIMEOUT_S
        while not (found := re.search(pattern, text := re.sub(
                r"\x1b\[\?2004[hl]", "", self.seen.decode(errors="replace")))):
            left = deadline - time.monotonic()
            assert left > 0 and self.proc.poll() is None, f"no {pattern!r} in:\n{text}"
            if select.select([self.master], [], [], min(left, 1.0))[0]:
                self.seen += os.read(self.master, 65536)
        if consume:
            self.seen = text[found.end():].encode()
        return found


def test_gpt_jax_chat_in_a_terminal(llama_dir, auto):
    """Two turns (the second's prompt found in the prefix cache), /reset, Ctrl-C in the
    middle of a reply (kept) then another turn, and Ctrl-D: exit status 0. Each turn
    prefills at most 32 tokens: one prefill program to compile."""
    first = "The quick brown fox jumps over the lazy dog while the assistant answers."
    term = Terminal(["-m", "gpt_jax.cli", "chat", "--hf-checkpoint", str(llama_dir),
                     "--temperature", "0", "--max-new-tokens", "6"])
    try:
        term.expect("Ctrl-D leaves")
        term.type(first + "\n")
        n, reused, prefilled = map(int, term.expect(SUMMARY).groups())
        assert n == len(auto_ids(auto, [{"role": "user", "content": first}]))  # one BOS
        term.type("Why?\n")
        n2, reused, prefilled = map(int, term.expect(SUMMARY).groups())
        assert n2 > n and reused >= 16 and reused + prefilled == n2  # turn 1's pages
        term.type("/reset\n")
        term.expect(r"\(conversation cleared\)")
        # no end in sight: past the context too (a reply stops at it by default)
        term.type("/set context_overflow crop\n/set max_new_tokens 2000\n/set min_tokens 2000\n")
        # the prompt first: typed ahead of it, "Bonjour!" is echoed before "> " is printed,
        # that ">" passed for the reply's first character and Ctrl-C went to input() instead
        # (a CI run: the typed line discarded, no reply, no summary)
        term.expect(r"\(min_tokens = 2000\)\r?\n> ")
        term.type("Bonjour!\n")
        term.expect(r"Bonjour!\r?\n")
        term.expect(r"\S", consume=False)  # the reply has begun
        term.type("\x03")
        assert term.expect(SUMMARY).group().endswith("; interrupted]")
        term.type("/set min_tokens 0\n/set max_new_tokens 4\nEncore?\n")
        n4, reused, _ = map(int, term.expect(SUMMARY).groups())
        unsaid = [{"role": "user", "content": "Bonjour!"}, {"role": "assistant", "content": ""},
                  {"role": "user", "content": "Encore?"}]
        assert n4 > len(auto_ids(auto, unsaid)) and reused >= 16  # what was said stayed in
        term.expect("> ")  # readline reads the terminal raw now: Ctrl-D is its EOF
        term.type("\x04")
        try:
            assert term.proc.wait(timeout=60) == 0
        except subprocess.TimeoutExpired:
            pytest.fail(f"Ctrl-D did not end it; it printed:\n{term.seen.decode()}")
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
        os.close(term.master)


# ---------------------------------------------------------------------- the page

def test_the_page_s_chat_mode_streams_two_turns_in_a_real_browser(served, llm, tmp_path):
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--disable-gpu", "--window-size=1000,1100"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options,
                              service=Service(shutil.which("chromedriver") or "chromedriver"))
    said = [{"role": "system", "content": "Be brief."}]
    try:
        driver.get(served + "/")
        field = lambda name: driver.find_element(By.ID, name)  # noqa: E731
        field("mode_chat").click()
        for name, value in (("system", said[0]["content"]), ("max_tokens", "24"),
                            ("temperature", "0")):
            field(name).clear()
            field(name).send_keys(value)
        for turn, content in enumerate(["Grüße! 🙂", "Encore?"]):
            field("message").send_keys(content)
            field("send").click()
            WebDriverWait(driver, TIMEOUT_S).until(
                lambda d: field("status").text.startswith("done") and len(
                    d.find_elements(By.CSS_SELECTOR, ".message.assistant .readout")) > turn)
            said.append({"role": "user", "content": content})
            expected, = solo_chat(llm, said, max_new_tokens=24, temperature=0.0)
            reply = driver.find_elements(By.CSS_SELECTOR, ".message.assistant")[turn]
            text = reply.find_element(By.CLASS_NAME, "text").get_attribute("textContent")
            assert text == expected.text  # (`.text` would be whitespace-normalized)
            assert int(reply.get_attribute("data-pieces")) >= 2  # streamed, not at once
            readout = reply.find_element(By.CLASS_NAME, "readout").text
            assert readout.startswith(f"{len(expected.tokens)} tokens · ")
            assert "tokens/s · TTFT " in readout and readout.endswith(
                f"finish: {expected.finish_reason}")
            said.append({"role": "assistant", "content": expected.text})
        assert [m.get_attribute("textContent") for m in driver.find_elements(
            By.CSS_SELECTOR, ".message.user .text")] == ["Grüße! 🙂", "Encore?"]
        WebDriverWait(driver, 10).until(lambda d: "KV pages" in field("server").text)
        assert field("error").text == ""
        driver.save_screenshot(str(tmp_path / "chat.png"))
    finally:
        driver.quit()


def test_gpt_jax_chat_refuses_in_one_line(llama_dir, tmp_path):
    """No chat template, no directory, a flag that does not apply: one line each, before
    the loop starts."""
    from inference.chat_cli import main

    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).symlink_to(llama_dir / name)
    for argv, said in ([["--hf-checkpoint", str(tmp_path)], "has no chat template; give one: "
                        "`gpt-jax chat --chat-template FILE`"],
                       [["--hf-checkpoint", str(tmp_path / "none")], "none"],
                       [["--hf-checkpoint", str(llama_dir), "--n", "2"], "--n and --logprobs"]):
        with pytest.raises(SystemExit) as caught:
            main(argv)
        message = str(caught.value.code)
        assert message.startswith("gpt-jax chat: ") and said in message, message
        assert "\n" not in message


def test_chat_set_names_an_unknown_field_and_takes_a_bare_word():
    """Faults: `/set bogus 1` answered with Python's `SamplingParams.__init__() got an
    unexpected keyword argument 'bogus'`, and `/set context_overflow error` was refused
    (`error` is not JSON), so no text field could be set without JSON quotes."""
    from inference.chat_cli import Chat, command

    chat = Chat(llm=None, sampling=SamplingParams())
    said = command(chat, "/set bogus 1")
    assert said.startswith("/set: unknown field 'bogus'; allowed: temperature, ") and \
        "context_overflow" in said and "__init__" not in said, said
    assert command(chat, "/set context_overflow error") == "(context_overflow = error)"
    assert command(chat, "/set top_p 0.5") == "(top_p = 0.5)"
    assert (chat.sampling.context_overflow, chat.sampling.top_p) == ("error", 0.5)
    said = command(chat, "/set top_p lots")
    assert said.startswith("/set top_p lots: SamplingParams.top_p='lots' ") and \
        chat.sampling.top_p == 0.5, said


def test_chat_set_refuses_what_a_chat_cannot_do_and_keeps_the_old_value():
    """Fault: `/set n 2` and `/set logprobs 5` were taken (the flags --n and --logprobs are
    refused: a reply is one text), and `/set speculative draft` without a draft model was
    taken too, so every later reply failed with `Engine(..., draft=...)` in its message."""
    from types import SimpleNamespace

    from inference.chat_cli import Chat, command

    chat = Chat(llm=SimpleNamespace(draft=None), sampling=SamplingParams())
    for line in ("/set n 2", "/set logprobs 5"):
        said = command(chat, line)
        assert said.startswith(f"{line}: n and logprobs do not apply to a chat"), said
    said = command(chat, "/set speculative draft")
    assert said.startswith("/set speculative draft: speculative='draft' needs a draft model"
                           ) and "--draft-run-dir" in said, said
    assert (chat.sampling.n, chat.sampling.logprobs, chat.sampling.speculative) == (1, None,
                                                                                    None)
    assert command(chat, "/set speculative ngram") == "(speculative = ngram)"
    chat.llm.draft = ("params", "config")
    assert command(chat, "/set speculative draft") == "(speculative = draft)"
    assert command(chat, "/set speculative null") == "(speculative = null)"
    assert chat.sampling.speculative is None


class ScriptedLLM:
    """An LLM stand-in for `Chat`: a context of `max_seq_len` tokens, a template whose
    prompt is one token per character of the messages' contents, and each reply's pieces
    as given (a piece is `(text, seconds after the previous one)`, on the clock `now`)."""

    def __init__(self, max_seq_len: int, pieces, now: list[float]):
        from types import SimpleNamespace

        self.config = SimpleNamespace(max_seq_len=max_seq_len)
        self.tokenizer = None
        self.chat_template = SimpleNamespace(
            encode=lambda tokenizer, messages: [0] * sum(len(m["content"]) for m in messages))
        self.pieces, self.now, self.prompts, self.samplings = pieces, now, [], []
        self.tokens = 1  # of each reply: n >= 1 tokens, "stop"; None: max_new_tokens, "length"
        self._engine = SimpleNamespace(page_size=16, stats=lambda: {
            "prefix_cache_hits": 0, "prefilled_tokens": 0})

    def engine(self, slots):
        return self._engine

    def stream_chat(self, conversations, sampling, max_batch_size):
        from inference.llm import Delta, TextCompletion

        self.prompts.append(conversations[0])
        self.samplings.append(sampling)
        n = sampling.max_new_tokens if self.tokens is None else self.tokens
        for k, (text, seconds) in enumerate(self.pieces):
            self.now[0] += seconds
            done = TextCompletion("", [1] * n, "length" if self.tokens is None else "stop",
                                  0) if k == len(self.pieces) - 1 else None
            yield Delta(0, text, done)


def test_chat_drops_the_oldest_exchanges_past_the_context_and_says_so(capsys):
    """Fault: a conversation past the model's context was cropped to its last max_seq_len
    tokens silently (its system message and template header cut off). Now whole exchanges
    go, oldest first, the system message stays, and stderr says how many and how many
    tokens, once; a message too long alone is said to be cropped."""
    import io

    from inference.chat_cli import Chat

    llm = ScriptedLLM(40, [("0123456789", 0.0), ("", 0.0)], [0.0])
    chat = Chat(llm, SamplingParams(), system="sys")  # 3 tokens
    err = io.StringIO()
    chat.reply("a" * 5, io.StringIO(), err)  # 3 + 5 + 10 = 18 tokens so far
    chat.reply("b" * 5, io.StringIO(), err)  # 18 + 5 + 10 = 33
    assert err.getvalue() == ""
    chat.reply("c" * 12, io.StringIO(), err)  # 33 + 12 = 45 > 40: the first exchange goes
    assert err.getvalue() == ("gpt-jax chat: the conversation outgrew the context (45 tokens > "
                              "max_seq_len 40): dropped the oldest 1 exchange (15 tokens; the "
                              "system message stays)\n")
    assert [m["content"] for m in llm.prompts[-1]] == ["sys", "b" * 5, "0123456789", "c" * 12]
    err = io.StringIO()
    chat.sampling = SamplingParams(context_overflow="crop")
    chat.reply("d" * 45, io.StringIO(), err)  # alone past it: every exchange goes, cropped
    assert err.getvalue().splitlines() == [
        "gpt-jax chat: the conversation outgrew the context (85 tokens > max_seq_len 40): "
        "dropped the oldest 2 exchanges (37 tokens; the system message stays)",
        "gpt-jax chat: this message makes a prompt of 48 tokens, past max_seq_len 40: its "
        "first 8 tokens are cropped"]
    assert [m["content"] for m in llm.prompts[-1]] == ["sys", "d" * 45]
    chat, err = Chat(llm, SamplingParams()), io.StringIO()  # None: the chat's "error"
    for message in ("a" * 20, "b" * 15):  # no system message: none said to stay
        chat.reply(message, io.StringIO(), err)
    assert err.getvalue() == (
        "gpt-jax chat: the conversation outgrew the context (45 tokens > max_seq_len 40): "
        "dropped the oldest 1 exchange (30 tokens)\n")


def test_chat_stops_a_reply_at_the_context_and_refuses_a_message_past_it():
    """Fault: `gpt-jax chat` ran under "crop" (the sampling flags' default), so a reply
    went on past the model's context, each token predicted from a window, and said nothing.
    Now, as vLLM's server and llama.cpp's (no context shift) do, a reply gets at most the
    tokens the context leaves and its line says it stopped there ("length"); a message
    that alone leaves no room is refused naming both lengths, the conversation kept.
    `--context-overflow crop` keeps the window, and its line says so."""
    import io

    from inference.chat_cli import Chat, ContextFull, parse_args
    from inference.sampling_flags import sampling_from_args

    assert sampling_from_args(parse_args(["--run-dir", "r"])).context_overflow == "error"
    llm = ScriptedLLM(40, [("x", 0.0), ("", 0.0)], [0.0])
    llm.tokens = None  # each reply: all of max_new_tokens, "length"
    chat = Chat(llm, SamplingParams(max_new_tokens=100, min_tokens=50,
                                    context_overflow="error"), system="sys")
    summary = chat.reply("a" * 10, io.StringIO(), io.StringIO())  # 3 + 10: 27 tokens left
    sent = llm.samplings[-1]
    assert (sent.max_new_tokens, sent.min_tokens, sent.context_overflow) == (27, 27, "error")
    assert re.search(r"; 27 tokens in [\d.]+ s; length: the context \(max_seq_len 40\) is "
                     r"full\]$", summary), summary
    turns = list(chat.turns)
    with pytest.raises(ContextFull) as caught:
        chat.reply("b" * 37, io.StringIO(), io.StringIO())  # 3 + 37 = 40: no room
    assert str(caught.value) == (
        "this message makes a prompt of 40 tokens with the system message, and the model's "
        "context is 40 tokens (max_seq_len): no room for a reply, so it was not sent; "
        "shorten it (or /set context_overflow crop to keep its last 40 tokens)")
    assert chat.turns == turns and len(llm.samplings) == 1
    chat.sampling = SamplingParams(max_new_tokens=30, context_overflow="crop")
    chat.turns = []
    summary = chat.reply("c" * 10, io.StringIO(), io.StringIO())  # 13 + 30 > 40
    assert llm.samplings[-1] == chat.sampling
    assert re.search(r"; 30 tokens in [\d.]+ s; length: past max_seq_len 40, each token "
                     r"was predicted from the last 40\]$", summary), summary


def test_chat_times_its_first_non_empty_text(monkeypatch):
    """Fault: "first text after" was the time of the first piece, even an empty one (the
    engine's pieces may carry no text)."""
    import io

    from inference import chat_cli

    now = [0.0]
    monkeypatch.setattr(chat_cli.time, "monotonic", lambda: now[0])
    llm = ScriptedLLM(100, [("", 1.0), ("Hi", 2.0), ("", 0.5)], now)
    summary = chat_cli.Chat(llm, SamplingParams()).reply("Hello", io.StringIO(), io.StringIO())
    assert "; first text after 3.00 s;" in summary, summary
