"""Chat requests: OpenAI-format messages rendered with the checkpoint's chat template (`tokenizer_config.json`),
exactly as transformers' `apply_chat_template` renders them: a sandboxed jinja2 environment with `trim_blocks`
and `lstrip_blocks`, the tokenizer's special tokens as variables, `add_generation_prompt` true. The rendered text
is tokenized without adding special tokens: the template writes them.
"""
from __future__ import annotations

import json
import os
from datetime import datetime

from .request import RequestError

MAX_MESSAGES = 4096


class ChatTemplate:
    def __init__(self, template: str, special_tokens: dict[str, str]) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
        self._template = env.from_string(template)
        self._special_tokens = special_tokens

    @classmethod
    def from_checkpoint(cls, path: str) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none."""
        file = os.path.join(path, "tokenizer_config.json")
        if not os.path.isfile(file):
            return None
        with open(file) as f:
            config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not template:
            return None
        special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token",
                                                                     "pad_token")}
        return cls(template, {k: v for k, v in special.items() if v is not None})

    def render(self, messages: list[dict]) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._special_tokens)
        except Exception as exc:  # the template's own raise_exception, or a message it cannot take
            raise RequestError(f"input 'messages': the chat template refused them: {exc}") from None


def parse_messages(raw: str) -> list[dict]:
    """OpenAI's format: a JSON list of {"role": str, "content": str or [{"type": "text", "text": str}, ...]}."""
    try:
        messages = json.loads(raw)
    except ValueError:
        raise RequestError("input 'messages' is not valid JSON") from None
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise RequestError(f"input 'messages' must be a JSON list of 1 to {MAX_MESSAGES} messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise RequestError(f"input 'messages': message {i} needs a string 'role' and a 'content'")
        content = message["content"]
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   for p in content):
                raise RequestError(f"input 'messages': message {i}: only text parts are supported")
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise RequestError(f"input 'messages': message {i}: 'content' must be a string or text parts")
        out.append({**message, "content": content})
    return out


def _token_text(token) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token
