"""Text front: stop strings on a toy multi-character vocabulary (a stop string that starts
inside a token, spans tokens, ends inside one, or sits inside one), streaming that never
leaks a stop string nor a broken UTF-8 character, and joins to the generated text."""

import dataclasses
import json

import numpy as np
import pytest

from conftest import lively_params
from inference import cli, engine
from gpt_jax.tokenizer import CharTokenizer
from inference import llm as llm_module
from inference.decode import CHUNK
from inference.llm import LLM
from inference.sampling_params import SamplingParams
from training import train as T
from training.config import TrainConfig

WIDTH = 5  # characters per token of the toy vocabulary


class PieceTokenizer:
    """64 distinct 5-character pieces over 'abcdefgh'; encode splits text into pieces."""

    def __init__(self):
        rng = np.random.default_rng(0)
        pieces = set()
        while len(pieces) < 64:
            pieces.add("".join(rng.choice(list("abcdefgh"), WIDTH)))
        self.pieces = sorted(pieces)
        self.ids = {p: i for i, p in enumerate(self.pieces)}

    def encode(self, text):
        return [self.ids[text[i:i + WIDTH]] for i in range(0, len(text), WIDTH)]

    def decode(self, ids):
        return "".join(self.pieces[int(i)] for i in ids)


class ByteTokenizer:
    """Byte-level: ids 0-31 are ASCII letters, 32-47 lead bytes of 2-byte UTF-8 characters
    (0xC2-0xD1), 48-63 continuation bytes (0x80-0x8F); decode replaces broken bytes."""

    BYTES = [ord(c) for c in "abcdefghijklmnopqrstuvwxyzABCDEF"] + list(range(0xC2, 0xD2)) + \
        list(range(0x80, 0x90))

    def encode(self, text):
        return [self.BYTES.index(b) for b in text.encode()]

    def decode(self, ids):
        return bytes(self.BYTES[int(i)] for i in ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def llm(config, params):
    return LLM(params, config, PIECES)


PIECES = PieceTokenizer()
PROMPT = PIECES.decode([5, 40])
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=48)


def first_at(text, width, offset, across_chunks):
    """A substring of `width` characters starting `offset` into a token, whose first
    occurrence in `text` is exactly there and which (if `across_chunks`) straddles the end
    of a compiled chunk, so that streaming sees only its beginning first (the first token
    comes with the prefill, then chunks of CHUNK tokens: text arrives in pieces that end at
    token 1, 1 + CHUNK, ...)."""
    chunk_chars = CHUNK * WIDTH
    for t in range(3, len(text) // WIDTH - 2):
        s = t * WIDTH + offset
        straddles = (s - WIDTH) // chunk_chars != (s + width - 1 - WIDTH) // chunk_chars
        if text.find(text[s:s + width]) == s and straddles == across_chunks:
            return s, text[s:s + width]
    raise AssertionError(f"no unique stop string candidate in {text!r}")


def joined_and_checked(deltas, n_rows):
    """Join each completion's deltas, asserting every partial join is a prefix of the final
    text (nothing shown is ever taken back) and the last delta carries the completion."""
    texts, completions = [""] * n_rows, [None] * n_rows
    for d in deltas:
        assert completions[d.index] is None, "delta after the completion's last"
        texts[d.index] += d.text
        completions[d.index] = d.completion
        if d.completion:
            assert texts[d.index] == d.completion.text
    for text, c in zip(texts, completions):
        assert c is not None and c.text.startswith(text)
    return texts, completions


@pytest.mark.parametrize("width, offset, across_chunks, case", [
    (9, 2, True, "starts inside a token, spans the next, ends inside the one after"),
    (4, 3, True, "starts inside a token, ends inside the next"),
    (3, 1, False, "sits inside one token"),
])
def test_stop_string_cuts_text_stops_the_row_and_never_streams(llm, width, offset,
                                                                across_chunks, case, monkeypatch):
    (full,) = llm.generate([PROMPT], GREEDY)
    assert len(set(llm.tokenizer.encode(full.text))) >= 5
    start, stop = first_at(full.text, width, offset, across_chunks)
    end = start + width
    other = PIECES.decode([17, 3, 60])
    (other_full,) = llm.generate([other], GREEDY)
    sampling = [SamplingParams(temperature=0.0, max_new_tokens=48, stop=["zzz", stop]), GREEDY]

    out, other_out = llm.generate([PROMPT, other], sampling)
    assert out.text == full.text[:start] and out.finish_reason == "stop"
    assert out.tokens == full.tokens[: -(-end // WIDTH)]  # through the completing token
    assert other_out.text == other_full.text  # the other row runs on, unchanged

    done = []  # per decode chunk: had row 0 (slot 0) left the batch before it?
    run_chunk = engine.engine_decode

    def engine_decode(params, config, state, page_table, live_B, *args, **kwargs):
        done.append(not bool(live_B[0]))
        return run_chunk(params, config, state, page_table, live_B, *args, **kwargs)

    monkeypatch.setattr(engine, "engine_decode", engine_decode)
    texts, completions = joined_and_checked(llm.stream([PROMPT, other], sampling), 2)
    assert texts == [out.text, other_out.text]
    assert completions[0].tokens == out.tokens
    # the first token comes with the prefill; then row 0 generates no more
    running_chunks = -(-(len(out.tokens) - 1) // CHUNK)
    assert done == [False] * running_chunks + [True] * (len(done) - running_chunks)

    done.clear()  # alone, the stopped row ends the run at the next chunk boundary
    (alone,) = llm.generate([PROMPT], sampling[0])
    assert alone.text == out.text and len(done) == running_chunks


def test_a_stop_prefix_that_never_completes_is_released(llm):
    (full,) = llm.generate([PROMPT], GREEDY)
    chunk_end = (1 + CHUNK) * WIDTH  # the prefill's first token, then a chunk
    tail = full.text[chunk_end - 3:chunk_end]  # streaming must hold it back for a chunk
    sampling = SamplingParams(temperature=0.0, max_new_tokens=48, stop=[tail + "z"])
    texts, (c,) = joined_and_checked(llm.stream([PROMPT], sampling), 1)
    assert texts == [full.text] and c.finish_reason == "length" and c.tokens == full.tokens


def test_a_stop_string_completed_inside_min_tokens_does_not_count(llm):
    """A stop string seen once in the greedy text, from 3 characters into token t to 2 into
    token t + 1: min_tokens t + 1 lets it stop the text (though it starts inside those
    tokens), t + 2 does not, and the whole text streams."""
    (full,) = llm.generate([PROMPT], GREEDY)
    text = full.text
    t = next(t for t in range(2, 40)
             if text.count(text[t * WIDTH + 3: t * WIDTH + 7]) == 1)
    stop = text[t * WIDTH + 3: t * WIDTH + 7]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=48, stop=[stop], min_tokens=t + 1)
    (out,) = llm.generate([PROMPT], sampling)
    assert (out.text, out.finish_reason) == (text[: t * WIDTH + 3], "stop")
    assert out.tokens == full.tokens[: t + 2]
    late = dataclasses.replace(sampling, min_tokens=t + 2)
    texts, (c,) = joined_and_checked(llm.stream([PROMPT], late), 1)
    assert texts == [text] and (c.text, c.finish_reason) == (text, "length")


def test_no_prompts_give_no_completions_and_no_deltas(llm):
    sampling = SamplingParams(max_new_tokens=5)
    assert llm.generate([], sampling) == []
    assert list(llm.stream([], sampling)) == []


def test_sampling_of_another_type_is_named_by_its_type(llm):
    """Fault: `llm.generate(["hi"], {"max_new_tokens": 3})` (a dict, as vLLM's kwargs look)
    said `sampling must be SamplingParams, got str`, naming a key of the dict."""
    for sampling, name in (({"max_new_tokens": 3}, "dict"), ("greedy", "str")):
        with pytest.raises(TypeError, match=f"sampling must be a SamplingParams or a list of "
                                            rf"them \(one per prompt\), got {name}$"):
            llm.generate([PROMPT], sampling)


def test_streamed_bytes_never_break_a_character(config):
    llm = LLM(lively_params(config, seed=3), config, ByteTokenizer())
    sampling = SamplingParams(temperature=1.5, max_new_tokens=64, n=8, seed=5)
    texts, completions = joined_and_checked(llm.stream(["abc"], sampling), 8)
    assert texts == [c.text for c in llm.generate(["abc"], sampling)]
    # the test can fail only if some chunk ended inside a character that a later token completed
    split = [k for c in completions for k in range(1, len(c.tokens), CHUNK)
             if not c.text.startswith(llm.tokenizer.decode(c.tokens[:k]))]
    assert split, "no character was split across a chunk boundary"
    assert any(ord(ch) > 127 and ch != "\ufffd" for t in texts for ch in t)


def test_n_samples_and_logprobs_reach_the_text_completion(llm):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, n=3, seed=2, logprobs=2)
    outs = llm.generate([PROMPT], sampling)
    assert len(outs) == 3 and len({o.text for o in outs}) == 3
    for o in outs:
        assert o.seed == 2 and len(o.logprobs) == len(o.tokens) == 8
        assert all(len(top) == 2 and max(top.values()) >= lp for top, lp in
                   zip(o.top_logprobs, o.logprobs))


# ---------------------------------------------------------------------- gpt-jax generate

EVERY_FLAG = ["--temperature", "0.7", "--top-k", "9", "--top-p", "0.9", "--min-p", "0.05",
              "--repetition-penalty", "1.1", "--presence-penalty", "0.2",
              "--frequency-penalty", "0.1", "--seed", "4", "--max-new-tokens", "12",
              "--stop-token-id", "7", "--stop-token-id", "8", "--stop", "zz\\n",
              "--stop-sequence", "1,2,3", "--logprobs", "2", "--n", "2", "--min-tokens", "3",
              "--logit-bias", "9=-100", "--logit-bias", "4=2.5", "--context-overflow", "error",
              "--regex", "[a-z]+"]  # one constraint per request: the other three below


def test_every_sampling_field_is_a_flag():
    sp = cli.sampling_from_args(cli.parse_args(EVERY_FLAG))
    default = SamplingParams()
    unset = [f.name for f in dataclasses.fields(SamplingParams)
             if getattr(sp, f.name) == getattr(default, f.name)]
    # one constraint at a time, and none with speculative decoding: those apart below
    assert unset == ["speculative", "num_speculative_tokens", "prompt_lookup_min",
                     "prompt_lookup_max", "json_schema", "choice", "json_object"]
    for flags, field, value in ((["--json-schema", '{"type": "integer"}'], "json_schema",
                                 '{"type": "integer"}'),
                                (["--choice", "a", "--choice", "b"], "choice", ("a", "b")),
                                (["--json-object"], "json_object", True),
                                (["--speculative", "ngram"], "speculative", "ngram"),
                                (["--speculative", "ngram", "--num-speculative-tokens", "2"],
                                 "num_speculative_tokens", 2),
                                (["--speculative", "ngram", "--prompt-lookup-min", "2"],
                                 "prompt_lookup_min", 2),
                                (["--speculative", "ngram", "--prompt-lookup-max", "4"],
                                 "prompt_lookup_max", 4)):
        assert getattr(cli.sampling_from_args(cli.parse_args(flags)), field) == value
    assert sp.stop == ("zz\n",) and sp.stop_sequences == ((1, 2, 3),)
    assert sp.stop_token_ids == (7, 8)
    assert sp.min_tokens == 3 and sp.logit_bias == ((4, 2.5), (9, -100.0))


def test_generate_json_and_streamed_text(llm, monkeypatch, capsys):
    monkeypatch.setattr(cli.LLM, "from_checkpoint", lambda run_dir, dtype, quantize, draft: llm)
    other = PIECES.decode([17, 3])
    argv = ["--prompt", PROMPT, "--prompt", other, "--temperature", "0.9", "--seed", "3",
            "--max-new-tokens", "10", "--n", "2"]
    expected = llm.generate([PROMPT, other], cli.sampling_from_args(cli.parse_args(argv)))
    cli.main(argv + ["--logprobs", "2", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert [r["text"] for r in rows] == [e.text for e in expected]
    assert [r["prompt"] for r in rows] == [PROMPT, PROMPT, other, other]
    assert all(r["finish_reason"] == "length" and len(r["tokens"]) == len(r["logprobs"]) == 10
               and len(r["top_logprobs"][0]) == 2 and r["seed"] == 3 for r in rows)

    cli.main(argv)
    rule = "=" * 72 + "\n"
    prompts = [PROMPT, PROMPT, other, other]
    assert capsys.readouterr().out == "".join(
        rule + p + e.text + "\n" for p, e in zip(prompts, expected)) + rule


def test_generate_json_says_what_repeats_each_sample(llm, monkeypatch, capsys):
    """Fault (a new user's trial): `generate --n 2 --json` printed the same seed for both
    samples and nothing else: a sample could not be repeated from its record. Each now has
    the seed, n and its sample_index, and those flags give its tokens again."""
    monkeypatch.setattr(cli.LLM, "from_checkpoint", lambda run_dir, dtype, quantize, draft: llm)
    argv = ["--prompt", PROMPT, "--temperature", "1", "--max-new-tokens", "10", "--json"]
    cli.main(argv + ["--n", "2"])
    first = json.loads(capsys.readouterr().out)
    assert [r["sample_index"] for r in first] == [0, 1] and first[0]["tokens"] != first[1]["tokens"]
    for row in first:
        cli.main(argv + ["--seed", str(row["seed"]), "--n", str(row["n"])])
        assert json.loads(capsys.readouterr().out)[row["sample_index"]]["tokens"] == row["tokens"]


def test_default_max_new_tokens_fits_the_models_context_under_error(llm, config, monkeypatch,
                                                                    capsys):
    monkeypatch.setattr(cli.LLM, "from_checkpoint", lambda run_dir, dtype, quantize, draft: llm)
    error = ["--context-overflow", "error"]
    cli.main(["--prompt", PROMPT, "--temperature", "0", "--json"] + error)  # 200 > 128 left
    (row,) = json.loads(capsys.readouterr().out)
    assert row["finish_reason"] == "length"
    assert len(row["tokens"]) == config.max_seq_len - len(PIECES.encode(PROMPT)) < 200
    full = PIECES.decode([5] * config.max_seq_len)  # no room left: an error, not 0 tokens
    with pytest.raises(SystemExit, match=r"^gpt-jax generate: prompt 0: prompt length 128 "
                       r"leaves no room for a new token in the model's max_seq_len 128; "
                       r"allowed: prompt length \+ --max-new-tokens 1 at most 128 \(or "
                       r"--context-overflow crop to predict each token from the last "
                       r"max_seq_len\)$"):  # the flag, not the Python field; the prompt named
        cli.main(["--prompt", full] + error)
    # crop, the CLI's default: 200 tokens whatever the prompt, past the context
    asked = []
    monkeypatch.setattr(cli, "print_stream", lambda llm, prompts, sampling: asked.append(sampling))
    cli.main(["--prompt", full + PROMPT])
    (sampling,) = asked
    assert sampling.max_new_tokens == 200 and sampling.context_overflow == "crop"


def test_llm_crops_unless_a_request_says_otherwise(llm, monkeypatch):
    """None (the SamplingParams default) is "crop" in LLM, "error" in generate and Engine."""
    added = []
    engine_ = llm.engine(32)
    monkeypatch.setattr(engine_, "add_request", lambda rid, prompt, sp: added.append(sp))
    list(llm.stream([PROMPT, PROMPT, PROMPT], [
        SamplingParams(max_new_tokens=500), SamplingParams(context_overflow="error"),
        SamplingParams(max_new_tokens=500, context_overflow="crop")]))
    assert [sp.context_overflow for sp in added] == ["crop", "error", "crop"]
    assert llm_module.crop_by_default(None) == SamplingParams(context_overflow="crop")
    with pytest.raises(ValueError, match=r"prompt length 2 \+ max_new_tokens 500 = 502 exceeds "
                       r"the model's max_seq_len 128; allowed: a sum of at most 128 \(or "
                       r"context_overflow=\"crop\" to predict each token from the last "
                       r"max_seq_len\)$"):
        list(llm.stream([PROMPT], SamplingParams(max_new_tokens=500, context_overflow="error")))


def test_generate_rejects_an_out_of_range_flag_before_loading(monkeypatch):
    monkeypatch.setattr(cli.LLM, "from_checkpoint",
                        lambda run_dir, dtype, quantize, draft: pytest.fail("loaded"))
    # in flags (a new user met SamplingParams' field names, which the CLI does not have)
    with pytest.raises(SystemExit, match=r"^gpt-jax generate: --top-p=1.5 is out of range; "
                                         r"allowed: \[0, 1\]$"):
        cli.main(["--top-p", "1.5"])
    with pytest.raises(SystemExit, match=r"^gpt-jax generate: --max-new-tokens=-1 is out of "
                                         r"range"):
        cli.main(["--max-new-tokens", "-1"])
    with pytest.raises(SystemExit, match=r"^gpt-jax generate: --stop-token-id="):
        cli.main(["--stop-token-id", "-3"])
    with pytest.raises(SystemExit):
        cli.main(["--top-q", "0.5"])  # unknown option: argparse exits


def test_an_empty_prompt_without_a_bos_is_refused_in_flags_and_by_llm(monkeypatch, llm):
    """Faults: `--prompt ""` was refused with advice to pass generate's bos_token_id, which
    the CLI has no flag for; then it was refused before loading, also for a tokenizer that
    adds BOS, where vLLM takes "" as [BOS] (test_chat_llama). Now it is refused after
    loading when the tokenizer adds none; `LLM.generate([""])` says the same, in its
    words, before any engine is made."""
    from types import SimpleNamespace

    monkeypatch.setattr(cli.LLM, "from_checkpoint", lambda run_dir, dtype, quantize, draft:
                        SimpleNamespace(tokenizer=PIECES))
    for argv in (["--prompt", ""], ["--prompt", PROMPT, "--prompt", ""]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == (
            "gpt-jax generate: --prompt is empty and the model's tokenizer adds no BOS; give a "
            "non-empty --prompt (the text the model continues), or no --prompt to start from "
            "a newline")
    engines = dict(llm._engines)
    with pytest.raises(ValueError) as caught:
        llm.generate([PROMPT, ""], GREEDY, progress=False)
    assert str(caught.value) == ("prompt 1 is empty: the text '' encodes to no tokens (this "
                                 "tokenizer adds no BOS); a prompt needs at least one token")
    assert llm._engines == engines


def test_an_eos_ending_keeps_the_eos_token_but_not_its_text(config, params, monkeypatch,
                                                              capsys):
    """Fault: the EOS token's text left in the completion's text. With a character
    tokenizer, the 5th greedy token is made the EOS id: the text is the decoding of the
    tokens before it, through generate, stream and the CLI."""
    chars = CharTokenizer(list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n"))
    llm = LLM(params, config, chars)
    prompt = next(p for p in ("Romeo", "Juliet", "Tybalt", "Mercutio 1", "Benvolio", "Capulet",
                              "Montague", "Paris", "Nurse", "Friar Laurence")
                  if len(set(llm.generate([p], SamplingParams(temperature=0.0, max_new_tokens=5),
                                          progress=False)[0].tokens)) == 5)
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=5),
                          progress=False)[0].tokens
    sampling = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=[greedy[4]])
    (out,) = llm.generate([prompt], sampling, progress=False)
    assert out.tokens == greedy and out.finish_reason == "eos"
    assert out.text == chars.decode(greedy[:4])
    deltas = list(llm.stream([prompt], sampling))
    assert "".join(d.text for d in deltas) == out.text
    assert dataclasses.replace(deltas[-1].completion, seed=out.seed) == out  # unseeded: new seed

    monkeypatch.setattr(cli.LLM, "from_checkpoint", lambda run_dir, dtype, quantize, draft: llm)
    cli.main(["--prompt", prompt, "--temperature", "0", "--max-new-tokens", "20",
              "--stop-token-id", str(greedy[4]), "--json"])
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["text"], row["tokens"], row["finish_reason"]) == (out.text, greedy, "eos")


def test_json_with_report_keeps_stdout_one_json_document(llm, monkeypatch, capsys):
    monkeypatch.setattr(cli.LLM, "from_checkpoint", lambda run_dir, dtype, quantize, draft: llm)
    cli.main(["--prompt", PROMPT, "--max-new-tokens", "4", "--json", "--report"])
    out, err = capsys.readouterr()
    assert len(json.loads(out)) == 1 and "KV cache:" in err and "decode:" in err
    # Fault: the timing runs drew two more unlabelled progress bars, as if generating again
    timing = err.split("timing: the same batch again, compiled first (texts not shown)\n")[1]
    assert "completion" not in timing and timing.startswith("prefill: ")


def test_bad_logit_bias_and_min_tokens_flags_are_named(llm, monkeypatch, capsys):
    for text in ("5", "x=1", "5=big"):
        with pytest.raises(SystemExit):
            cli.parse_args(["--logit-bias", text])
        assert f"expected ID=BIAS such as 50256=-100, got {text!r}" in capsys.readouterr().err
    monkeypatch.setattr(cli.LLM, "from_checkpoint", lambda run_dir, dtype, quantize, draft: llm)
    with pytest.raises(SystemExit, match=r"--logit-bias id 64 is outside \[0, 64\)"):
        cli.main(["--prompt", PROMPT, "--logit-bias", "64=1"])
    with pytest.raises(SystemExit, match=r"--min-tokens=30 is more than --max-new-tokens=20"):
        cli.main(["--prompt", PROMPT, "--max-new-tokens", "20", "--min-tokens", "30"])


def test_malformed_token_id_lists_are_named(capsys):
    for flag in ("--prompt-ids", "--stop-sequence"):
        with pytest.raises(SystemExit):
            cli.parse_args([flag, "1,x"])
        assert "expected comma-separated token ids such as 1,2,3, got '1,x'" in \
            capsys.readouterr().err


def test_bpe_run_generates_text_through_its_saved_tokenizer(corpus, tmp_path, capfd):
    from gpt_jax.tokenizer import BPETokenizer
    from inference import SamplingParams
    from inference.llm import LLM

    cfg = TrainConfig.preset("tiny", text=str(corpus), tokenizer="bpe", bpe_vocab_size=300,
                               run_dir=str(tmp_path / "bpe"), max_steps=2, eval_interval=2)
    T.train(cfg)
    llm = LLM.from_checkpoint(cfg.run_dir)
    assert isinstance(llm.tokenizer, BPETokenizer) and llm.config.vocab_size == 300
    with pytest.raises(ValueError, match=r"has no checkpoint at step 7; its steps are \[2\]"):
        LLM.from_checkpoint(cfg.run_dir, step=7)
    with pytest.raises(TypeError, match="got a bare string"):
        llm.generate("The king", progress=False)
    capfd.readouterr()
    with pytest.raises(TypeError, match="got a bare string"):  # before any progress bar
        llm.generate("The king")
    assert capfd.readouterr().err == ""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    out = llm.generate(["The king speaks ✓"], sampling, progress=False)[0]
    assert len(out.tokens) == 8
    assert out.text == llm.tokenizer.decode(out.tokens)
