"""Chat with a Llama-style model from a Hugging Face directory, end to end: a small random
Llama (save_hf) beside a Llama 3 tokenizer whose tokenizer.json adds <|begin_of_text|>
itself, Llama 3's chat template, and generation_config.json's EOS list (<|end_of_text|>,
<|eom_id|>, <|eot_id|>, as Llama 3.1 Instruct ships it).

The rendered template already starts with `bos_token`: our prompt ids equal
`transformers`' `apply_chat_template(..., tokenize=True)` (one BOS, not two). Then
`gpt-jax serve --hf-checkpoint DIR` (a subprocess) answers chat completions (streamed and
not, n = 2, seed, stop, logprobs) as `LLM.from_pretrained(DIR).chat` does, and each id of
the EOS list ends a reply with finish_reason "stop", absent from the text."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gpt_jax import GPTConfig, save_hf
from gpt_jax.tokenizer import BPETokenizer
from inference import LLM, SamplingParams
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
    for messages in CONVERSATIONS:
        text = llm.chat_template.render(messages)
        assert text.startswith(BOS) and llm.tokenizer.encode(text)[:2] == [0, 0]  # the trap
        ids = llm.chat_template.encode(llm.tokenizer, messages)
        assert ids == auto_ids(auto, messages) and ids.count(0) == 1
