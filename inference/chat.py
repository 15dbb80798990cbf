"""Chat templates: a conversation rendered to prompt text the way `transformers`'
`apply_chat_template` renders it, so a model sees the prompt it was instruction-tuned on.

    template = ChatTemplate.from_dir("SmolLM2-135M-Instruct")  # or ChatTemplate(source, tokens)
    text = template.render([{"role": "user", "content": "Hi"}])  # ends "<|im_start|>assistant\n"

A template is Jinja run in jinja2's immutable sandbox (templates come from the Hub: untrusted
code), with transformers' settings (trim_blocks, lstrip_blocks, loop controls) and the names
templates use: `messages`, `add_generation_prompt`, `tools`/`documents` (None), the
tokenizer's special tokens (`bos_token`, `eos_token`, ...), `raise_exception`,
`strftime_now`, a `tojson` filter that does not escape HTML (transformers' own), and the
`{% generation %}` block tag (rendered as its body; transformers uses it to mark assistant
tokens for training). Messages are checked first: role system, developer, user or
assistant, content a string or a list of text parts (joined by newlines, as vLLM joins
them, so every template sees a string). "developer" is OpenAI's newer name for the system
message: a template that never names it as a string (Llama's, Qwen's, SmolLM2's: they know
system/user/assistant/tool; some raise on any other role, others drop it unrendered) sees
it as "system", as llama.cpp's server maps it (and vLLM's Responses API); one that names it
(gpt-oss's) sees it as given.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path

from inference.errors import RequestError

ROLES = ("system", "developer", "user", "assistant")
# A template that compares a role with "developer" knows that role; others see it as "system".
KNOWS_DEVELOPER = re.compile(r"""["']developer["']""")
# Tokens that end a turn in the common template families (Qwen/SmolLM2's ChatML, Llama 3,
# Phi-3, Gemma); those a template writes stop generation, beside the EOS token.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")
HOW_TO_SUPPLY = ("give one: `gpt-jax serve --chat-template FILE`, "
                 "`LLM.from_checkpoint(..., chat_template=FILE)`, `LLM(..., chat_template=TEXT)`, "
                 "or a chat_template.jinja (or tokenizer_config.json with a chat_template) in "
                 "the model's directory")


class NoChatTemplate(ValueError):
    """A chat request for a model without a chat template."""


def _message_error(problem: str, allowed: str) -> RequestError:
    """A RequestError on field "messages"; braces are doubled (RequestError formats its
    words, and a template's message or a role may hold braces)."""
    escape = lambda text: text.replace("{", "{{").replace("}", "}}")  # noqa: E731
    return RequestError("messages", None, escape(allowed), problem=escape(problem), owner="")


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The jinja2 Template of `source`, in the environment transformers renders chat
    templates in (`transformers.utils.chat_template_utils._cached_compile_jinja_template`)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _content(index: int, content) -> str:
    """A message's content as text: a string, or a list of text parts joined by newlines.
    Raises RequestError naming the message for any other part (an image) or shape."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _message_error(f"messages[{index}].content is of type {type(content).__name__}",
                             "a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise _message_error(f"messages[{index}].content[{j}] is not a text part "
                                 f"(type {kind!r})",
                                 'text parts ({"type": "text", "text": ...}) only: this model '
                                 "takes no images or other media")
        texts.append(part["text"])
    return "\n".join(texts)


def check_messages(messages) -> list[dict]:
    """The conversation as the template sees it: a list of {"role", "content": str}.
    Raises RequestError (field "messages") for an empty conversation, an unknown role or
    content that is not text."""
    if not isinstance(messages, list) or not messages:
        raise _message_error("messages must be a non-empty list", "a list of messages, each "
                             '{"role": "system" | "developer" | "user" | "assistant", '
                             '"content": ...}')
    out = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise _message_error(f"messages[{i}] has role {role!r}", f"roles {list(ROLES)}")
        out.append({"role": role, "content": _content(i, message.get("content"))})
    return out


class ChatTemplate:
    """A Jinja chat template and the special tokens it may name (`bos_token`, `eos_token`,
    ...: the token strings, as `tokenizer_config.json` gives them)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        """Raises ValueError for a template that is empty or not valid Jinja (here, not at
        the first request)."""
        import jinja2

        if not isinstance(source, str) or not source.strip():
            raise ValueError("a chat template must be non-empty Jinja text")
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            compile_template(source)
        except jinja2.exceptions.TemplateSyntaxError as error:
            raise ValueError(f"the chat template is not valid Jinja: {error} (line "
                             f"{error.lineno})") from None

    def render(self, messages, add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (a "developer" message as "system" unless the
        template names that role). Raises RequestError (field "messages") for bad
        messages or a template that refuses them (its own message: e.g. "Conversation
        roles must alternate user/assistant/user/assistant/...")."""
        import jinja2

        checked = check_messages(messages)
        if not KNOWS_DEVELOPER.search(self.source):
            checked = [m | {"role": "system"} if m["role"] == "developer" else m
                       for m in checked]
        try:
            return compile_template(self.source).render(
                messages=checked, tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.exceptions.TemplateError as error:
            raise _message_error(f"the model's chat template refused the conversation: {error}",
                                 "a conversation the template accepts") from None

    def encode(self, tokenizer, messages) -> list[int]:
        """The prompt ids of a conversation: its rendered text encoded without the
        tokenizer's own special tokens, as `apply_chat_template(..., tokenize=True)` encodes
        it (the template writes them: Llama 3's begins with `bos_token`, which a tokenizer
        that adds BOS would otherwise double). Raises as `render`, and ValueError for text
        a character tokenizer cannot encode."""
        return tokenizer.encode(self.render(messages), add_special_tokens=False)

    def end_of_turn_tokens(self) -> list[str]:
        """The token strings that end the model's turn: the EOS token and the known
        end-of-turn tokens the template writes."""
        eos = self.special_tokens.get("eos_token")
        return ([eos] if eos else []) + [t for t in END_OF_TURN
                                         if t in self.source and t != eos]

    @classmethod
    def from_file(cls, path, special_tokens: dict[str, str] | None = None) -> ChatTemplate:
        """A template file (Jinja text) given by the user."""
        return cls(Path(path).read_text(encoding="utf-8"), special_tokens)

    @classmethod
    def load(cls, directory, path=None) -> ChatTemplate | None:
        """The template file `path` with the model directory's special tokens (so a given
        template's `bos_token` is the model's), else the directory's own (`from_dir`).
        Raises OSError, ValueError for a template that cannot be read or parsed."""
        if path is None:
            return cls.from_dir(directory)
        return cls.from_file(path, special_tokens(_tokenizer_config(Path(directory))))

    @classmethod
    def from_dir(cls, directory) -> ChatTemplate | None:
        """The template of a model directory: `chat_template.jinja`, else
        `tokenizer_config.json`'s `chat_template` (a string, or a list of {name, template}
        of which "default" is taken); with that config's special tokens. None when neither
        has one."""
        directory = Path(directory)
        config_path = directory / "tokenizer_config.json"
        config = _tokenizer_config(directory)
        tokens = special_tokens(config)
        jinja_path = directory / "chat_template.jinja"
        if jinja_path.exists():
            return cls.from_file(jinja_path, tokens)
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source}
            if "default" not in named:
                raise ValueError(f"{config_path} has chat templates {sorted(named)} and no "
                                 "'default'")
            source = named["default"]
        return None if source is None else cls(source, tokens)


def _tokenizer_config(directory: Path) -> dict:
    path = directory / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def special_tokens(tokenizer_config: dict) -> dict[str, str]:
    """The special token strings of a `tokenizer_config.json` (a token may be a string or
    an {"content": ...} object)."""
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        token = tokenizer_config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            out[key] = token
    return out


def token_ids(tokenizer, tokens: list[str]) -> list[int]:
    """The ids of those `tokens` that are one token of `tokenizer` (each encodes to a single
    id: an added special token does)."""
    ids = []
    for token in tokens:
        try:
            encoded = tokenizer.encode(token, add_special_tokens=False)  # no BOS before
        except ValueError:  # a character tokenizer without one of its characters
            continue
        if len(encoded) == 1 and encoded[0] not in ids:
            ids.append(encoded[0])
    return ids
