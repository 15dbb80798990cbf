"""`gpt-jax generate` and `gpt-jax chat` with `--speculative draft --draft-run-dir DIR`
(`inference.draft_engine.read_draft`): greedy text and token ids equal to decoding without
speculation, and the draft flags refused, naming the flag, where they would be ignored or
where the draft model is missing or has another tokenizer."""

from __future__ import annotations

import pytest

from gpt_jax import GPTConfig, checkpoint
from gpt_jax.tokenizer import CharTokenizer
from inference import chat_cli, cli
from tests.conftest import lively_params
from tests.live_server import save_run
from tests.test_speculative_draft import _perturbed

GREEDY = ["--temperature", "0", "--max-new-tokens", "24", "--no-compile-cache"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A target run and a draft run of the same tokenizer whose params differ a little (its
    drafts are accepted and refused)."""
    config = GPTConfig.preset("tiny")
    params = lively_params(config, scale=3.0)
    root = tmp_path_factory.mktemp("draft_cli")
    return (str(save_run(root / "target", config, params)),
            str(save_run(root / "draft", config, _perturbed(params))))


def test_generate_with_a_draft_model_prints_the_text_and_ids_of_speculation_off(runs, capsys):
    """Fault: `gpt-jax generate` accepted only `--speculative ngram`."""
    target, draft = runs
    with_draft = ["--speculative", "draft", "--draft-run-dir", draft,
                  "--num-speculative-tokens", "3"]
    printed = []
    for prompt in (["--prompt", "12345"], ["--prompt-ids", "1,2,3,4,5"]):
        for extra in ([], with_draft):
            cli.main(["--run-dir", target, *prompt, *GREEDY, *extra])
            printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and printed[2] == printed[3]
    assert len(printed[2].split(",")) == 24


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_draft_flags_are_refused_where_they_would_be_ignored_or_missing(command):
    """Fault: `--draft-run-dir DIR` without `--speculative draft` would be ignored silently,
    and `--speculative draft` without a draft model would fail only at the first request.
    Refused before loading (no such model)."""
    main = {"generate": cli.main, "chat": chat_cli.main}[command]
    said = {}
    for flags in (["--draft-run-dir", "D"], ["--speculative", "ngram", "--draft-hf-checkpoint", "H"],
                  ["--speculative", "draft"]):
        with pytest.raises(SystemExit) as raised:
            main(["--run-dir", "/nonexistent", *flags])
        said[flags[-1]] = str(raised.value.code)
    assert said == {
        "D": f"gpt-jax {command}: --draft-run-dir D applies only to --speculative draft; add "
             "--speculative draft, or leave it out",
        "H": f"gpt-jax {command}: --draft-hf-checkpoint H applies only to --speculative draft; "
             "add --speculative draft, or leave it out",
        "draft": f"gpt-jax {command}: --speculative draft needs a draft model: add "
                 "--draft-run-dir DIR or --draft-hf-checkpoint DIR (same tokenizer as the model)"}


def test_generate_refuses_a_draft_of_another_tokenizer_in_one_line(runs, tmp_path):
    target, draft = runs
    other = tmp_path / "other"
    save_run(other, GPTConfig.preset("tiny"), lively_params(GPTConfig.preset("tiny")))
    checkpoint.save_tokenizer(other, CharTokenizer([chr(ord("A") + i) for i in range(64)]))
    with pytest.raises(SystemExit) as raised:
        cli.main(["--run-dir", target, "--speculative", "draft", "--draft-run-dir", str(other),
                  *GREEDY])
    assert str(raised.value.code).startswith(
        "gpt-jax generate: the draft model's tokenizer (char, 64 tokens) differs from the "
        "target's")
