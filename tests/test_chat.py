"""Chat templates render as `transformers`' `apply_chat_template` does: for three public
templates (Llama 3's, Qwen2.5's, SmolLM2's, written here from their tokenizer_config.json:
templates are text) and conversations with a system message, several turns and non-ASCII
text, our prompt text and token ids equal transformers' on the same byte-level BPE tokenizer
(trained here, with the templates' special tokens); and `LLM.chat` / `LLM.stream_chat`."""

import json

import numpy as np

import pytest

from gpt_jax.tokenizer import BPETokenizer
from inference import SamplingParams
from inference.chat import ChatTemplate, check_messages
from inference.errors import RequestError

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# Llama 3.2's (its tool-calling branches left out): today's date through strftime_now.
LLAMA32 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")

# Gemma's way: no system role, turns must alternate; and the {% generation %} tag.
STRICT = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ '<start_of_turn>model\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endgeneration %}{% else %}{{ '<start_of_turn>user\n' + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<start_of_turn>model\n' }}{% endif %}{{ {'k': 'é<a>'} | tojson }}")

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>",
           "<start_of_turn>", "<end_of_turn>"]
TOKENS = {LLAMA3: ("<|begin_of_text|>", "<|eot_id|>"), LLAMA32: ("<|begin_of_text|>", "<|eot_id|>"),
          QWEN25: ("<|endoftext|>", "<|im_end|>"), SMOLLM2: ("<|im_start|>", "<|im_end|>"),
          STRICT: ("<bos>", "<eos>")}  # bos_token, eos_token of each

CORPUS = "\n".join([
    "The quick brown fox jumps over the lazy dog while the assistant answers questions.",
    "You are a helpful assistant. Please answer briefly and politely, in full sentences.",
    "Grüße aus München: Straße, Bäume, Käse und Frühstück für alle Gäste.",
    "Le café est très bon à Paris; l'élève répète la leçon à la fenêtre.",
    "東京で日本語を勉強しています。今日は天気がいいですね。",
    "Привет, как дела? Сегодня хорошая погода для прогулки.",
    "Emoji too: 🙂 🚀 ✨ and math: ∑ x² ≤ ∞.",
] * 12)

CONVERSATIONS = [
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "  Réponds en français.  "},
     {"role": "user", "content": "Bonjour! Comment ça va?"},
     {"role": "assistant", "content": "Très bien, merci. Et vous?"},
     {"role": "user", "content": "Grüße aus München 🙂"},
     {"role": "assistant", "content": "東京からこんにちは。"},
     {"role": "user", "content": "Привет, и до свидания."}],
    [{"role": "user", "content": "No system message here.\nTwo lines."}],
]


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.from_text(CORPUS, vocab_size=600, special_tokens=tuple(SPECIAL))


def hf_tokenizer(bpe, template):
    from transformers import PreTrainedTokenizerFast

    bos, eos = TOKENS[template]
    return PreTrainedTokenizerFast(tokenizer_object=bpe.tokenizer, bos_token=bos, eos_token=eos,
                                   chat_template=template)


def ours(template):
    bos, eos = TOKENS[template]
    return ChatTemplate(template, {"bos_token": bos, "eos_token": eos})


def hf_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("template", [LLAMA3, LLAMA32, QWEN25, SMOLLM2],
                         ids=["llama3", "llama3.2", "qwen2.5", "smollm2"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_prompt_ids_equal_transformers_apply_chat_template(bpe, template, conversation):
    messages = CONVERSATIONS[conversation]
    hf = hf_tokenizer(bpe, template)
    text = ours(template).render(messages)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert bpe.encode(text) == hf_ids(hf, messages)
    # the template's tokens are single ids, not bytes
    for token in ("<|im_start|>", "<|eot_id|>", "<|begin_of_text|>"):
        if token in text:
            assert bpe.tokenizer.token_to_id(token) in bpe.encode(text)
    without = ours(template).render(messages, add_generation_prompt=False)
    assert without == hf.apply_chat_template(messages, add_generation_prompt=False,
                                             tokenize=False)


def test_raise_exception_generation_tag_and_tojson_as_transformers(bpe):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye ✨"}]
    text = ours(STRICT).render(messages)
    assert text == hf_tokenizer(bpe, STRICT).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith('{"k": "é<a>"}')  # transformers' tojson: no HTML escapes, no \u
    for bad, said in [([{"role": "system", "content": "x"}] + messages, "System role not "
                       "supported"), (messages[:1] * 2, "roles must alternate")]:
        with pytest.raises(RequestError) as caught:
            ours(STRICT).render(bad)
        assert caught.value.field == "messages" and said in str(caught.value)


# gpt-oss's way (reduced): a template that names the developer role renders it its own way.
KNOWS_DEVELOPER = (
    "{% for m in messages %}{% if m.role == 'developer' %}{{ '<|start|>developer<|message|># "
    "Instructions\n\n' + m.content + '<|end|>' }}{% else %}{{ '<|start|>' + m.role + "
    "'<|message|>' + m.content + '<|end|>' }}{% endif %}{% endfor %}<|start|>assistant")


@pytest.mark.parametrize("template", [LLAMA3, LLAMA32, QWEN25, SMOLLM2],
                         ids=["llama3", "llama3.2", "qwen2.5", "smollm2"])
def test_a_developer_message_is_the_system_message_of_a_template_without_that_role(bpe,
                                                                                  template):
    """Fault: role "developer" (OpenAI's newer name for system instructions) was refused.
    Passed to these templates as it is, Llama's would render a "developer" header the
    model never saw and Qwen2.5's would drop the message and write its default system
    prompt; so a template that does not name the role sees "system" (llama.cpp's server
    maps it so): the prompt is transformers' for the same conversation with "system"."""
    hf = hf_tokenizer(bpe, template)
    for messages in CONVERSATIONS[:2]:
        developer = [m | {"role": "developer"} if m["role"] == "system" else m for m in messages]
        assert ours(template).render(developer) == hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False)
    with pytest.raises(RequestError, match="System role not supported"):  # as a system one
        ours(STRICT).render([{"role": "developer", "content": "x"}])
    said = ChatTemplate(KNOWS_DEVELOPER).render([{"role": "developer", "content": "Be brief."},
                                                 {"role": "user", "content": "Hi"}])
    assert said == ("<|start|>developer<|message|># Instructions\n\nBe brief.<|end|><|start|>"
                    "user<|message|>Hi<|end|><|start|>assistant")


def test_messages_are_checked_and_text_parts_joined():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b {x}"}]}]
    assert check_messages(parts) == [{"role": "user", "content": "a\nb {x}"}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    for bad, said in [([], "non-empty"), ([{"role": "tool", "content": "x"}], "role 'tool'"),
                      (image, "messages[0].content[0] is not a text part (type 'image_url')"),
                      ([{"role": "user", "content": 3}], "content is of type int")]:
        with pytest.raises(RequestError) as caught:
            check_messages(bad)
        assert caught.value.field == "messages" and said in str(caught.value)


def test_a_template_from_a_model_directory(tmp_path):
    config = {"bos_token": {"content": "<s>"}, "eos_token": "<|im_end|>",
              "chat_template": [{"name": "tool_use", "template": "T"},
                                {"name": "default", "template": SMOLLM2}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    found = ChatTemplate.from_dir(tmp_path)
    assert found.source == SMOLLM2 and found.special_tokens == {"bos_token": "<s>",
                                                                "eos_token": "<|im_end|>"}
    assert found.end_of_turn_tokens() == ["<|im_end|>"]
    (tmp_path / "chat_template.jinja").write_text(LLAMA3)
    assert ChatTemplate.from_dir(tmp_path).source == LLAMA3  # the .jinja file wins
    assert ChatTemplate.from_dir(tmp_path / "..") is None


# ---------------------------------------------------------------------- LLM.chat and the server

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
SLOTS = 4
TIMEOUT_S = 120  # a first request compiles its programs on the engine thread: slow on a loaded machine
TALK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße! 🙂"},
        {"role": "assistant", "content": "Bonjour."}, {"role": "user", "content": "Encore?"}]


@pytest.fixture(scope="module")
def chat_llm(bpe):
    from conftest import lively_params
    from gpt_jax import GPTConfig
    from inference import LLM

    config = GPTConfig(vocab_size=bpe.vocab_size, max_seq_len=160, n_layers=2, n_heads=2,
                       d_model=32)
    return LLM(lively_params(config), config, bpe, chat_template=CHATML)


@pytest.fixture(scope="module")
def chat_url(chat_llm):
    from inference import Engine
    from inference.server import ServerConfig
    from live_server import running, wait_ready

    cfg = ServerConfig("chat", chat_template=ChatTemplate(CHATML))
    engine = lambda: Engine(chat_llm.params, chat_llm.config, chat_llm.tokenizer,  # noqa: E731
                            max_slots=SLOTS)
    with running(engine, cfg) as base:
        wait_ready(base)
        yield base


@pytest.fixture(scope="module")
def chat_client(chat_url):
    import openai

    return openai.OpenAI(base_url=f"{chat_url}/v1", api_key="none", max_retries=0)


def solo_chat(llm, messages, **fields):
    return llm.chat([messages], SamplingParams(**fields), max_batch_size=SLOTS, progress=False)


def test_llm_chat_stops_at_the_end_of_turn_token_and_leaves_it_out(chat_llm, bpe):
    end = bpe.tokenizer.token_to_id("<|im_end|>")
    out, = solo_chat(chat_llm, TALK, max_new_tokens=20, min_tokens=3, logit_bias={end: 100.0})
    # "stop", as vLLM's LLM.chat and the server report it; the id ends `tokens`
    assert out.finish_reason == "stop" and out.tokens[-1] == end and len(out.tokens) == 4
    assert out.text == bpe.decode(out.tokens[:-1]) and "<|im_end|>" not in out.text
    prompt = ChatTemplate(CHATML).render(TALK)
    plain, = chat_llm.generate([prompt], SamplingParams(
        max_new_tokens=12, seed=3, stop_token_ids=[end]), max_batch_size=SLOTS, progress=False)
    chatted, = solo_chat(chat_llm, TALK, max_new_tokens=12, seed=3)
    assert chatted.tokens == plain.tokens  # chat = generate on the rendered prompt
    streamed = {}
    sp = SamplingParams(max_new_tokens=12, seed=4, n=2)
    for delta in chat_llm.stream_chat([TALK], sp, max_batch_size=SLOTS):
        streamed[delta.index] = streamed.get(delta.index, "") + delta.text
    assert [streamed[0], streamed[1]] == [c.text for c in chat_llm.chat(
        [TALK], sp, max_batch_size=SLOTS, progress=False)]


def test_llm_without_a_template_says_how_to_supply_one(chat_llm):
    from inference import LLM
    from inference.chat import NoChatTemplate

    bare = LLM(chat_llm.params, chat_llm.config, chat_llm.tokenizer)
    with pytest.raises(NoChatTemplate, match="chat_template"):
        bare.chat([TALK])
    with pytest.raises(TypeError, match="wrap a single conversation"):
        chat_llm.chat(TALK)


def test_chat_completions_equal_llm_chat_n2_stop_seed_logprobs(chat_client, chat_llm):
    fields = dict(max_new_tokens=24, temperature=0.9, seed=7, n=2, logprobs=2)
    ref = solo_chat(chat_llm, TALK, **fields)
    texts = [r.text for r in ref]
    stop = next(t[4:6] for t in texts if len(t) >= 8)  # a stop string one sample meets
    ref = solo_chat(chat_llm, TALK, **fields, stop=[stop])
    r = chat_client.chat.completions.create(
        model="chat", messages=TALK, max_completion_tokens=24, temperature=0.9, seed=7, n=2,
        logprobs=True, top_logprobs=2, stop=stop)
    assert r.object == "chat.completion" and [c.index for c in r.choices] == [0, 1]
    assert any(c.finish_reason == "stop" for c in r.choices)
    for choice, expected in zip(r.choices, ref):
        assert choice.message.role == "assistant" and choice.message.content == expected.text
        assert choice.finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[
            expected.finish_reason]
        content = choice.logprobs.content
        assert [c.token for c in content] == [chat_llm.tokenizer.decode([t])
                                              for t in expected.tokens]
        np.testing.assert_allclose([c.logprob for c in content], expected.logprobs, atol=1e-5)
        assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode())
                   for c in content)
    assert r.usage.completion_tokens == sum(len(e.tokens) for e in ref)


def test_streamed_chat_chunks_join_to_the_reply(chat_client, chat_llm):
    ref = solo_chat(chat_llm, TALK, max_new_tokens=20, temperature=0.8, seed=2, n=2)
    stream = chat_client.chat.completions.create(
        model="chat", messages=TALK, max_tokens=20, temperature=0.8, seed=2, n=2, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    firsts = {}
    texts, finish = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            firsts.setdefault(c.index, c.delta.role)
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert firsts == {0: "assistant", 1: "assistant"}
    assert [texts[0], texts[1]] == [r.text for r in ref]
    assert finish == {k: {"eos": "stop", "stop": "stop", "length": "length"}[r.finish_reason]
                      for k, r in enumerate(ref)}
    assert chunks[-1].usage.completion_tokens == sum(len(r.tokens) for r in ref)


def test_a_developer_message_is_served_as_the_system_message(chat_client, chat_llm):
    """Fault: role "developer" was a 400 ("roles ['system', 'user', 'assistant']")."""
    developer = [TALK[0] | {"role": "developer"}] + TALK[1:]
    expected, = solo_chat(chat_llm, TALK, max_new_tokens=8, temperature=0.0)
    r = chat_client.chat.completions.create(model="chat", messages=developer, max_tokens=8,
                                            temperature=0)
    assert r.choices[0].message.content == expected.text
    assert r.usage.prompt_tokens == len(ChatTemplate(CHATML).encode(chat_llm.tokenizer, TALK))


def test_the_end_of_turn_token_ends_a_chat_with_stop_not_in_the_text(chat_client, bpe):
    end = bpe.tokenizer.token_to_id("<|im_end|>")
    r = chat_client.chat.completions.create(
        model="chat", messages=TALK, max_tokens=20, logit_bias={str(end): 100},
        extra_body={"min_tokens": 2})
    choice, = r.choices
    assert choice.finish_reason == "stop" and r.usage.completion_tokens == 3
    assert "<|im_end|>" not in choice.message.content


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "auto"), ("response_format", {"type": "xml"}),  # json_object: supported
    ("messages", [{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": "http://x/a.png"}}]}]),
    ("messages", [{"role": "tool", "content": "x"}]), ("top_logprobs", 2)])
def test_an_unsupported_chat_field_is_a_400_naming_it(chat_url, field, value):
    import httpx2 as httpx

    body = {"model": "chat", "messages": TALK, field: value}
    r = httpx.post(f"{chat_url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert field in error["message"] or "messages[0]" in error["message"]


def test_a_template_that_refuses_the_conversation_is_a_400_with_its_message(chat_llm):
    import httpx2 as httpx

    from inference import Engine
    from inference.server import ServerConfig
    from live_server import running, wait_ready

    engines = [lambda: Engine(chat_llm.params, chat_llm.config, chat_llm.tokenizer,
                              max_slots=SLOTS)]
    for cfg, said in [(ServerConfig("strict", chat_template=ChatTemplate(STRICT)),
                       "System role not supported"),
                      (ServerConfig("none"), "--chat-template FILE")]:
        with running(engines[0], cfg) as base:
            wait_ready(base)
            r = httpx.post(f"{base}/v1/chat/completions", json={"messages": TALK}, timeout=TIMEOUT_S)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "messages" and said in error["message"]


def test_a_run_directory_s_template_and_serve_s_chat_template_flag(tmp_path, chat_llm):
    from conftest import lively_params
    from gpt_jax import checkpoint
    from inference import LLM
    from inference.serve import _chat_template, parse_args

    run = tmp_path / "run"
    params = lively_params(chat_llm.config)  # the training layout, as a run saves it
    checkpoint.save_config(run, chat_llm.config)
    checkpoint.save_tokenizer(run, chat_llm.tokenizer)
    checkpoint.save(checkpoint.manager(run), 1, params, params, {"step": 1})
    assert LLM.from_checkpoint(run).chat_template is None
    (run / "chat_template.jinja").write_text(CHATML)
    assert LLM.from_checkpoint(run).chat_template.source == CHATML
    given = tmp_path / "smol.jinja"
    given.write_text(SMOLLM2)
    assert LLM.from_checkpoint(run, chat_template=given).chat_template.source == SMOLLM2
    args = parse_args(["--run-dir", str(run), "--chat-template", str(given)])
    assert _chat_template(args.chat_template, run).source == SMOLLM2
    assert _chat_template(None, run).source == CHATML
    (tmp_path / "bad.jinja").write_text("{% for %}")
    with pytest.raises(SystemExit, match="not valid Jinja"):
        _chat_template(str(tmp_path / "bad.jinja"), run)


def test_32_concurrent_two_turn_chat_streams_equal_their_solo_results_and_hit_the_cache(
        chat_llm):
    import asyncio

    import openai

    from inference import Engine
    from inference.server import ServerConfig
    from live_server import metric, running, wait_ready

    rng = np.random.default_rng(1)
    words = CORPUS.split()
    openers = [" ".join(rng.choice(words, 12)) for _ in range(32)]  # distinct first pages
    asks = [(int(rng.integers(4, 20)), int(rng.integers(0, 2**31))) for _ in range(32)]
    engine = lambda: Engine(chat_llm.params, chat_llm.config, chat_llm.tokenizer,  # noqa: E731
                            max_slots=SLOTS, num_pages=400)  # no cached page evicted

    async def turn(client, messages, max_tokens, seed):
        text, reason = "", None
        stream = await client.chat.completions.create(
            model="chat", messages=messages, max_tokens=max_tokens, temperature=0.8,
            seed=seed, stream=True)
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def all_turns(client, conversations):
        async with client:
            return await asyncio.wait_for(asyncio.gather(*(
                turn(client, c, *a) for c, a in zip(conversations, asks))), 300)

    with running(engine, ServerConfig("chat", chat_template=ChatTemplate(CHATML))) as base:
        wait_ready(base)
        new_client = lambda: openai.AsyncOpenAI(base_url=f"{base}/v1",  # noqa: E731
                                                api_key="none", max_retries=0)
        firsts = [[{"role": "user", "content": o}] for o in openers]
        replies = asyncio.run(all_turns(new_client(), firsts))
        first_hits = metric(base, "gpt_jax:prefix_cache_hit_rate")
        seconds = [c + [{"role": "assistant", "content": text},
                        {"role": "user", "content": "And then? Ça va?"}]
                   for c, (text, _) in zip(firsts, replies)]
        replies2 = asyncio.run(all_turns(new_client(), seconds))
        assert metric(base, "gpt_jax:prefix_cache_hit_rate") > first_hits + 0.1
        assert metric(base, "gpt_jax:kv_pages_used") == 0
    finish = {"eos": "stop", "stop": "stop", "length": "length"}
    for conversations, results in ((firsts, replies), (seconds, replies2)):
        for messages, (max_tokens, seed), got in zip(conversations, asks, results):
            ref, = solo_chat(chat_llm, messages, max_new_tokens=max_tokens, temperature=0.8,
                             seed=seed)
            assert got == (ref.text, finish[ref.finish_reason]), messages


def test_a_conversation_a_char_tokenizer_cannot_encode_is_a_400(config, params):
    import httpx2 as httpx

    from inference import Engine
    from inference.server import ServerConfig
    from live_server import TOKENIZER, running, wait_ready

    cfg = ServerConfig("chars", chat_template=ChatTemplate("{{ messages[-1].content }}"))
    with running(lambda: Engine(params, config, TOKENIZER, max_slots=2), cfg) as base:
        wait_ready(base)
        ok = httpx.post(f"{base}/v1/chat/completions", timeout=TIMEOUT_S,
                        json={"messages": [{"role": "user", "content": "AB"}], "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": TALK}, timeout=TIMEOUT_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "cannot be encoded" in r.json()["error"]["message"]


def test_a_chat_reply_under_response_format_json_schema_fits_it_and_equals_solo(chat_client,
                                                                                chat_llm):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                               "why": {"type": "string", "maxLength": 8}},
              "required": ["answer", "why"]}
    r = chat_client.chat.completions.create(
        model="chat", messages=TALK, max_tokens=40, seed=5, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    import jsonschema

    reply = r.choices[0].message.content
    jsonschema.validate(json.loads(reply), schema)
    assert r.choices[0].finish_reason == "stop"
    assert reply == solo_chat(chat_llm, TALK, max_new_tokens=40, seed=5,
                              json_schema=schema)[0].text
