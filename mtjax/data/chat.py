"""Chat conversations rendered with a checkpoint's own template, as transformers renders them.

    template = chat.find(checkpoint_dir)               # None: the checkpoint has no chat template
    text = template.render(messages, add_generation_prompt=True)
    text, spans = template.answer_spans(messages)      # [start, end) characters of each answer

A Hugging Face checkpoint keeps its chat template (Jinja2 source) in chat_template.jinja
or under `chat_template` in tokenizer_config.json. transformers' `apply_chat_template`
renders it in an immutable sandboxed Jinja2 environment with trim_blocks and
lstrip_blocks, the loop controls extension, a `{% generation %}` block tag, the
`raise_exception(message)` and `strftime_now(format)` helpers, a `tojson` filter that
leaves HTML characters alone, and the tokenizer's special tokens (`bos_token`,
`eos_token`, ...) as variables beside `messages`, `tools`, `documents` and
`add_generation_prompt`; keys of a message whose value is null are dropped first.
`render` does all of that, so the text trained on is the text the model is served.

The answers of a conversation, the characters the model learns to write, are found by
rendering prefixes: assistant message i spans from the end of
render(messages[:i], add_generation_prompt=True) to the end of render(messages[:i + 1]).
For ChatML (Qwen2) that is the message's content, its `<|im_end|>` and the newline the
template writes after it. A template that renders earlier turns differently once later
turns follow has no such spans and is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mtjax import textfile
from mtjax.data.format import DataError

ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (templates mark answers with it)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise DataError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None


def render(source: str, messages: list[dict], add_generation_prompt: bool = False,
           special_tokens: dict[str, str] | None = None) -> str:
    """The text of `messages` under the Jinja2 chat template `source`, as
    `apply_chat_template(messages, tokenize=False, ...)` gives it; `special_tokens` are the
    tokenizer's (e.g. {"bos_token": "<s>", "eos_token": "</s>"}). A template that refuses
    the conversation (its raise_exception) raises DataError with its message."""
    template = _compile(source)
    plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        return template.render(**(special_tokens or {}), messages=plain, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt)
    except jinja2.exceptions.TemplateError as e:
        raise DataError(f"the chat template refuses this conversation: {e}") from None


def check_messages(messages) -> list[dict]:
    """`messages` if it is a non-empty list of {role, content} with known roles and text."""
    if not isinstance(messages, list) or not messages:
        raise DataError("`messages` must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"message {i} must be an object with `role` and `content`")
        if m["role"] not in ROLES:
            raise DataError(f"message {i} has role {m['role']!r}; roles are {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise DataError(f"message {i} ({m['role']}) has {type(m['content']).__name__} content; it must be text")
        if not m["content"].strip():
            raise DataError(f"message {i} ({m['role']}) has empty content; remove the message or fill it")
    return messages


@dataclasses.dataclass(frozen=True)
class Template:
    """A chat template and the special tokens it renders with."""

    source: str
    special_tokens: dict = dataclasses.field(default_factory=dict)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return render(self.source, messages, add_generation_prompt, self.special_tokens)

    def answer_spans(self, messages: list[dict], first: int = 0) -> tuple[str, list[tuple[int, int]]]:
        """(rendered conversation, [start, end) of each assistant message from index `first` on)."""
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if i < first or message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            after = self.render(messages[:i + 1])
            if not (after.startswith(before) and text.startswith(after)):
                raise DataError(f"the chat template renders message {i} differently once later turns follow, "
                                "so its answer cannot be located; use --train-on all or another template")
            if len(after) > len(before):
                spans.append((len(before), len(after)))
        return text, spans

    def turn_end(self) -> str:
        """What the template writes right after an assistant message's content (ChatML:
        "<|im_end|>\\n"); its first token is where generation of an answer stops."""
        probe = "\x00answer\x00"
        text = self.render([{"role": "user", "content": "question"}, {"role": "assistant", "content": probe}])
        if probe not in text:
            raise DataError("the chat template does not write the assistant's content verbatim")
        return text[text.index(probe) + len(probe):]

    def to_json(self) -> dict:
        return {"source": self.source, "special_tokens": self.special_tokens}

    @classmethod
    def from_json(cls, record: dict) -> Template:
        return cls(record["source"], dict(record.get("special_tokens", {})))


def find(tokenizer_spec: str | Path) -> Template | None:
    """The chat template beside a tokenizer (a checkpoint dir, or the dir of its
    tokenizer.json): chat_template.jinja, else tokenizer_config.json's `chat_template`
    (a string, or a list of named templates of which "default" is used); None if neither."""
    folder = Path(tokenizer_spec)
    if not folder.is_dir():
        folder = folder.parent
    config = {}
    if (folder / CONFIG_FILE).is_file():
        try:
            config = json.loads(textfile.read(folder / CONFIG_FILE))
        except json.JSONDecodeError as e:
            raise DataError(f"{folder / CONFIG_FILE} is not JSON ({e})") from None
    special = {}
    for key, value in config.items():
        if key.endswith("_token") and isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            special[key] = value
    if (folder / TEMPLATE_FILE).is_file():
        return Template(textfile.read(folder / TEMPLATE_FILE), special)
    source = config.get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    return Template(source, special) if isinstance(source, str) and source else None
