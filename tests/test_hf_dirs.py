"""A Hugging Face directory used end to end, against `transformers` as the reference: a small
random Llama saved with `save_pretrained` beside a byte-level BPE tokenizer saved by
`PreTrainedTokenizerFast.save_pretrained` (BOS and EOS special tokens). Our tokenizer gives
AutoTokenizer's ids (BOS included) and decodes as it does without special tokens;
`LLM.from_pretrained` greedy text is transformers' generate decoded; every EOS id of
config.json and generation_config.json stops; `gpt-jax generate --hf-checkpoint` prints it.
"""

import json
import shutil
import sys

import pytest

from conftest import assert_lively
from gpt_jax.hf import load_hf_eos_token_ids, load_hf_tokenizer
from inference import LLM, SamplingParams
from test_hf import assert_same_greedy, torch, transformers

TEXT = ("the quick brown fox jumps over the lazy dog; to be, or not to be, that is the "
        "question. hello world! a model that reads a directory end to end.\n") * 8
TEXTS = ["the quick brown fox", "to be, or not</s> to be", "héllo wörld ✓", "<s>question"]
BOS, EOS = "<s>", "</s>"
NEW_TOKENS = 16


def _tokenizer_object():
    """A byte-level BPE trained on TEXT, with BOS and EOS as ids 0 and 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[BOS, EOS])
    tok.train_from_iterator(TEXT.splitlines(keepends=True), trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """(path, model): a Llama (GQA 2:1, untied, random N(0, 0.2) matrices: lively) with
    bos 0 and eos 1, and its tokenizer, saved as transformers saves them."""
    tok = _tokenizer_object()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS,
                                                eos_token=EOS, add_bos_token=True)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=96, bos_token_id=0, eos_token_id=1, pad_token_id=None,
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0,
                      0.2 if p.ndim >= 2 else 0.1, generator=gen)
    path = tmp_path_factory.mktemp("llama-dir")
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path, model


def _auto_ids(path, text):
    return transformers.AutoTokenizer.from_pretrained(path)(text)["input_ids"]


def test_token_ids_equal_autotokenizers_bos_included(hf_dir):
    path, _ = hf_dir
    ours = load_hf_tokenizer(path)
    auto = transformers.AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        ids = auto(text)["input_ids"]
        assert ids[0] == 0 and 1 in ours.encode("a</s>b")  # BOS added, EOS one id
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == auto.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize("add_bos", [True, False])
@pytest.mark.parametrize("post_processor", [True, False])
def test_bos_is_added_as_autotokenizer_adds_it(hf_dir, tmp_path, add_bos, post_processor):
    """tokenizer_config.json's `add_bos_token` either way, with and without tokenizer.json's
    BOS post-processor: the ids are AutoTokenizer's (the post-processor decides)."""
    path, _ = hf_dir
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, tmp_path / name)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    if not post_processor:
        data["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                "add_bos_token": add_bos}))
    ours = load_hf_tokenizer(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == _auto_ids(tmp_path, text), text


def _hf_generate(model, ids, **kw):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.long), do_sample=False, max_new_tokens=NEW_TOKENS,
                             pad_token_id=1, output_logits=True, return_dict_in_generate=True,
                             **kw)
    return out.sequences[0, len(ids):].tolist(), torch.stack(out.logits)[:, 0].numpy()


def test_from_pretrained_greedy_text_equals_transformers(hf_dir):
    path, model = hf_dir
    llm = LLM.from_pretrained(path)
    auto = transformers.AutoTokenizer.from_pretrained(path)
    assert llm.eos_token_ids == (1,)
    matched = 0
    for prompt in TEXTS[:3]:
        ref, logits = _hf_generate(model, auto(prompt)["input_ids"])
        (out,) = llm.generate([prompt], SamplingParams(temperature=0.0,
                                                       max_new_tokens=NEW_TOKENS),
                              progress=False)
        assert_same_greedy(out.tokens, ref, logits, prompt)
        if out.tokens == ref:  # else a near-tie, allowed above
            matched += 1
            assert out.text == auto.decode(ref, skip_special_tokens=True)
            assert out.finish_reason == ("eos" if ref[-1] == 1 else "length")
    assert matched >= 2


def test_each_eos_id_of_generation_config_stops(hf_dir, tmp_path):
    """generation_config.json's `eos_token_id` list: each id ends generation (finish
    reason "eos", the id kept), as config.json's does."""
    path, model = hf_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        (tmp_path / name).symlink_to(path / name)
    prompt = TEXTS[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    (free,) = LLM.from_pretrained(path).generate([prompt], greedy, progress=False)
    tokens = free.tokens[:-1] if free.finish_reason == "eos" else free.tokens
    assert_lively(tokens, 4)
    firsts = sorted({tokens.index(t) for t in tokens if t != 1})[1:4]  # first occurrences
    assert len(firsts) == 3
    for at in firsts:
        stop = tokens[at]
        (tmp_path / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": [2 if stop != 2 else 3, stop], "bos_token_id": 0}))
        assert load_hf_eos_token_ids(tmp_path)[1:] == ((2 if stop != 2 else 3), stop)
        (out,) = LLM.from_pretrained(tmp_path).generate([prompt], greedy, progress=False)
        assert out.tokens == tokens[:at + 1] and out.finish_reason == "eos", stop


def test_cli_generate_hf_checkpoint_prints_from_pretrained_text(hf_dir, capsys):
    from inference.cli import main

    path, _ = hf_dir
    main(["--hf-checkpoint", str(path), "--prompt", TEXTS[0], "--temperature", "0",
          "--max-new-tokens", str(NEW_TOKENS), "--json"])
    printed = json.loads(capsys.readouterr().out)
    (expected,) = LLM.from_pretrained(path).generate(
        [TEXTS[0]], SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS), progress=False)
    assert printed[0]["text"] == expected.text and printed[0]["tokens"] == expected.tokens
    assert_lively(expected.tokens, 4)


def test_serve_hf_checkpoint_answers_as_from_pretrained(hf_dir):
    """`gpt-jax serve --hf-checkpoint DIR` (a subprocess): a greedy completion is the text
    `LLM.from_pretrained(DIR).generate` gives; a seeded n=2 sampled one, asked with the
    official openai client, has the tokens of `LLM` and of `inference.generate` for the same
    seed (the model: GQA 2:1, untied)."""
    import openai

    from conftest import free_port, start_serve

    path, _ = hf_dir
    port = free_port()
    proc = start_serve(["--hf-checkpoint", str(path), "--max-slots", "2", "--no-warmup"], port)
    try:
        llm = assert_greedy_served(port, path, TEXTS[1])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        served = client.completions.create(model=path.name, prompt=TEXTS[0],
                                           max_tokens=NEW_TOKENS, temperature=0.9, seed=7,
                                           n=2, logprobs=1)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    _assert_seeded_pair_served(llm, served)


def assert_greedy_served(port: int, path, text: str) -> LLM:
    """The server on `port` (serving the Hugging Face directory `path`) completes `text`
    greedily, NEW_TOKENS tokens, with the text `LLM.from_pretrained(path)` gives; returns
    that LLM."""
    import httpx2 as httpx

    body = {"model": path.name, "prompt": text, "max_tokens": NEW_TOKENS, "temperature": 0}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    llm = LLM.from_pretrained(path)
    (expected,) = llm.generate(
        [text], SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS), progress=False)
    assert r.json()["choices"][0]["text"] == expected.text
    return llm


def _assert_seeded_pair_served(llm, served):
    """The server's seeded n=2 answer `served` holds the tokens `llm` and
    `inference.generate` sample for TEXTS[0] with seed 7: two different lively samples."""
    from inference import generate

    sampling = SamplingParams(temperature=0.9, seed=7, n=2, max_new_tokens=NEW_TOKENS)
    ours = llm.generate([TEXTS[0]], sampling, progress=False)
    direct = generate(llm.params, llm.config, [llm.tokenizer.encode(TEXTS[0])],
                      SamplingParams(temperature=0.9, seed=7, n=2, max_new_tokens=NEW_TOKENS,
                                     stop_token_ids=[1]))
    assert [o.tokens for o in ours] == [o.tokens for o in direct]
    assert ours[0].tokens != ours[1].tokens
    for choice, expected in zip(served.choices, ours, strict=True):
        assert_lively(expected.tokens, 4)
        assert choice.text == expected.text
        assert choice.logprobs.tokens == [llm.tokenizer.decode([t]) for t in expected.tokens]
    assert served.usage.completion_tokens == sum(len(o.tokens) for o in ours)


def _torch_save(state: dict, folder, shards: int) -> None:
    """`state` as transformers wrote PyTorch pickles (before safetensors, or with
    safe_serialization=False): `pytorch_model.bin`, or shards and their index."""
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return
    names, weight_map = sorted(state), {}
    for k in range(shards):
        file = f"pytorch_model-{k + 1:05d}-of-{shards:05d}.bin"
        torch.save({n: state[n] for n in names[k::shards]}, folder / file)
        weight_map |= {n: file for n in names[k::shards]}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("dtype, files", [("float16", "safetensors"), ("float16", "bin"),
                                          ("bfloat16", "bin shards")])
def test_float16_and_torch_pickle_directories_load_their_weights(hf_dir, tmp_path, dtype,
                                                                 files):
    """A directory of float16 safetensors, or of PyTorch pickles (one file, or shards with
    their index), loads the weights it holds: the float32 directory's rounded to its dtype."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from gpt_jax import load_hf

    path, model = hf_dir
    shutil.copy(path / "config.json", tmp_path / "config.json")
    if files == "safetensors":
        tensors = load_file(path / "model.safetensors")
        save_file({k: v.astype(dtype) for k, v in tensors.items()},
                  tmp_path / "model.safetensors", metadata={"format": "pt"})
    else:
        _torch_save({k: v.to(getattr(torch, dtype)) for k, v in model.state_dict().items()},
                    tmp_path, shards=2 if "shards" in files else 1)
    _, expected = load_hf(path)
    _, params = load_hf(tmp_path)
    rounded = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, dtype), np.float32), expected)
    assert not jax.tree.all(jax.tree.map(np.array_equal, rounded, expected))  # it did round
    jax.tree.map(np.testing.assert_array_equal, params, rounded)
    assert jax.tree.all(jax.tree.map(lambda x: x.dtype == np.float32, params))


def test_a_torch_pickle_without_torch_is_one_line_naming_the_file(hf_dir, tmp_path,
                                                                  monkeypatch):
    """torch is optional: a directory holding only pytorch_model.bin, where torch is not
    installed, stops `gpt-jax generate` with one line naming the file and the way out."""
    from inference.cli import main

    path, model = hf_dir
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, tmp_path / name)
    _torch_save(model.state_dict(), tmp_path, shards=1)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(SystemExit) as stop:
        main(["--hf-checkpoint", str(tmp_path), "--prompt", "a", "--max-new-tokens", "2"])
    assert str(stop.value) == (
        f"gpt-jax generate: {tmp_path / 'pytorch_model.bin'} is a PyTorch pickle, which only "
        "torch reads, and torch is not installed: install torch (`pip install torch`), or "
        "save the weights as model.safetensors")
