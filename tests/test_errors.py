"""RequestError (inference/errors.py): what a bad request carries, and how each front names
the field in it without reading the message back."""

import pytest

from inference import SamplingParams
from inference.errors import RequestError


def test_the_message_names_the_field_the_value_and_what_is_allowed_as_each_front_does():
    error = RequestError("min_tokens", 9, "0 <= {min_tokens} <= {max_new_tokens}",
                         problem="{field}={value!r} is more than {max_new_tokens}=8")
    assert isinstance(error, ValueError)
    assert (error.field, error.value, error.code) == ("min_tokens", 9, "invalid_value")
    assert str(error) == ("SamplingParams.min_tokens=9 is more than max_new_tokens=8; "
                          "allowed: 0 <= min_tokens <= max_new_tokens")
    assert error.message("min_tokens", {"max_new_tokens": "max_tokens"}) == (  # the server
        "min_tokens=9 is more than max_tokens=8; allowed: 0 <= min_tokens <= max_tokens")
    assert error.message("--min-tokens") == (  # the command line: the flag it was given by
        "--min-tokens=9 is more than max_new_tokens=8; allowed: 0 <= min_tokens <= "
        "max_new_tokens")
    plain = RequestError("top_p", 2.0, "[0, 1]", owner="")
    assert str(plain) == "top_p=2.0 is out of range; allowed: [0, 1]"


@pytest.mark.parametrize("fields, field, value, code", [
    (dict(temperature=-1.0), "temperature", -1.0, "invalid_value"),
    (dict(top_k=1.5), "top_k", 1.5, "invalid_type"),
    (dict(top_p=2.0), "top_p", 2.0, "invalid_value"),
    (dict(min_p=float("nan")), "min_p", None, "invalid_value"),
    (dict(repetition_penalty=0.0), "repetition_penalty", 0.0, "invalid_value"),
    (dict(presence_penalty=3.0), "presence_penalty", 3.0, "invalid_value"),
    (dict(frequency_penalty=-3.0), "frequency_penalty", -3.0, "invalid_value"),
    (dict(seed=-1), "seed", -1, "invalid_value"),
    (dict(max_new_tokens=-1), "max_new_tokens", -1, "invalid_value"),
    (dict(stop_token_ids=[-3]), "stop_token_ids", -3, "invalid_value"),
    (dict(stop=[""]), "stop", "", "invalid_value"),
    (dict(logprobs=21), "logprobs", 21, "invalid_value"),
    (dict(n=0), "n", 0, "invalid_value"),
    (dict(stop_sequences=[[]]), "stop_sequences", (), "invalid_value"),
    (dict(min_tokens=9, max_new_tokens=8), "min_tokens", 9, "invalid_value"),
    (dict(logit_bias={5: 101.0}), "logit_bias", 101.0, "invalid_value"),
    (dict(logit_bias=[(5,)]), "logit_bias", (5,), "invalid_type"),
    (dict(logit_bias=5), "logit_bias", 5, "invalid_type"),
    (dict(context_overflow="wrap"), "context_overflow", "wrap", "invalid_value"),
])
def test_every_bad_sampling_field_raises_a_request_error_naming_it(fields, field, value, code):
    with pytest.raises(RequestError) as raised:
        SamplingParams(**fields)
    error = raised.value
    assert (error.field, error.code) == (field, code)
    if value is not None:  # NaN equals nothing
        assert error.value == value
    assert str(error).startswith(f"SamplingParams.{field}") and "; allowed: " in str(error)


def test_a_request_check_carries_its_code_request_and_hint_as_data(config):
    """`check_request` (inference/validation.py): the prompt index or request id and the
    "crop" remedy are attributes, so each front words them its own way."""
    from inference.validation import CROP, check_request

    C = config.max_seq_len
    with pytest.raises(RequestError) as raised:
        check_request(config, [1] * (C - 2), SamplingParams(max_new_tokens=5), request=3)
    error = raised.value
    assert (error.field, error.value, error.code, error.request, error.hint) == (
        "max_new_tokens", 5, "context_length_exceeded", 3, CROP)
    assert str(error).endswith(  # the library: today's text, the hint as a Python setting
        '(or context_overflow="crop" to predict each token from the last max_seq_len)')
    assert error.message("max_tokens", setting=None) == (  # the server: no hint
        f"prompt 3: prompt length {C - 2} + max_tokens 5 = {C + 3} exceeds the model's "
        f"max_seq_len {C}; allowed: a sum of at most {C}")
    assert error.message("--max-new-tokens", setting="--context-overflow {value}").endswith(
        "(or --context-overflow crop to predict each token from the last max_seq_len)")
    crop = SamplingParams(max_new_tokens=5, context_overflow="crop")
    assert check_request(config, [2] * (C + 5), crop, request="a") == [2] * C
    with pytest.raises(RequestError) as raised:  # the page pool: at most 6 pages of 8
        check_request(config, [1] * 40, SamplingParams(max_new_tokens=20), request="big",
                      page_size=8, num_pages=6)
    assert (raised.value.field, raised.value.request) == ("max_new_tokens", "big")
    assert str(raised.value).startswith("request 'big': prompt length 40 + max_new_tokens 20 "
                                        "needs 8 pages of 8 tokens, but the page pool has 6")


def test_a_prompt_given_as_a_numpy_or_jax_array_is_its_list(config):
    """Fault: `generate(params, config, [np.array([1, 2])], ...)` raised numpy's "The truth
    value of an array with more than one element is ambiguous" from the request check."""
    import jax.numpy as jnp
    import numpy as np

    from inference.validation import check_request

    greedy = SamplingParams(temperature=0.0, max_new_tokens=2)
    for prompt in (np.array([1, 2]), jnp.array([1, 2], jnp.int32)):
        assert check_request(config, prompt, greedy, request=0) == [1, 2]
    with pytest.raises(RequestError, match="prompt 0 is empty"):
        check_request(config, np.array([], np.int32), greedy, request=0)


def test_the_command_line_names_every_field_by_its_flag_in_generate_and_chat():
    """Fault: `gpt-jax generate --speculative ngram --num-speculative-tokens 0` said
    `num_speculative_tokens=0`, `--min-tokens 20 --max-new-tokens 8` said `max_new_tokens=8`
    and `--regex a --choice b` said `got regex too`, and `gpt-jax chat --top-p 2` said
    `SamplingParams.top_p=2.0`: names the user cannot type."""
    import argparse
    import dataclasses

    from inference.sampling_flags import FIELD_FLAGS, add_sampling_args, refusal

    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    assert set(FIELD_FLAGS) == {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(FIELD_FLAGS.values()) <= flags

    def said(command="generate", **fields):
        with pytest.raises(RequestError) as raised:
            SamplingParams(**fields)
        return refusal(raised.value, command).code

    assert said(speculative="ngram", num_speculative_tokens=0) == (
        "gpt-jax generate: --num-speculative-tokens=0 is out of range; allowed: [1, 8]")
    assert said(prompt_lookup_min=3, prompt_lookup_max=2) == (
        "gpt-jax generate: --prompt-lookup-min=3 is more than --prompt-lookup-max=2; "
        "allowed: 1 <= --prompt-lookup-min <= --prompt-lookup-max")
    assert said("chat", min_tokens=20, max_new_tokens=8) == (
        "gpt-jax chat: --min-tokens=20 is more than --max-new-tokens=8; allowed: 0 <= "
        "--min-tokens <= --max-new-tokens")
    assert said(regex="a", choice=["b"]) == (
        "gpt-jax generate: --choice is given with another constraint; allowed: at most one "
        "constraint (got --regex too)")
    assert refusal(ValueError("no model"), "chat").code == "gpt-jax chat: no model"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_speculative_only_flag_without_speculative_is_refused_naming_it(command):
    """Fault: `--prompt-lookup-min 2` (or `--prompt-lookup-max`, `--num-speculative-tokens`)
    without `--speculative` was ignored silently. Refused before loading (no such model)."""
    from inference import chat_cli, cli

    main = {"generate": cli.main, "chat": chat_cli.main}[command]
    for flag in ("--prompt-lookup-min", "--prompt-lookup-max", "--num-speculative-tokens"):
        with pytest.raises(SystemExit) as raised:
            main(["--run-dir", "/nonexistent", flag, "2"])
        assert str(raised.value.code) == (
            f"gpt-jax {command}: {flag} 2 applies only to speculative decoding; add "
            "--speculative ngram, or leave it out")
    sampling = cli.sampling_from_args(cli.parse_args(["--speculative", "ngram",
                                                      "--prompt-lookup-min", "2"]))
    assert (sampling.prompt_lookup_min, sampling.prompt_lookup_max,
            sampling.num_speculative_tokens) == (2, SamplingParams.prompt_lookup_max,
                                                 SamplingParams.num_speculative_tokens)
