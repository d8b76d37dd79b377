"""Rendering a model's chat template the way transformers' `apply_chat_template` does.

Same jinja2 sandbox and settings (trim_blocks, lstrip_blocks, loopcontrols, the `{% generation %}`
block), same globals (`raise_exception`, `strftime_now`, `namespace`, `dict`) and the same `tojson`
(no ASCII escaping, `indent` supported). Messages are normalised first as the OpenAI wire allows:
content may be a string, null or an array of parts (semantics.md §3.8, inference-api `content`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.errors import KilnError

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
# transformers passes reasoning under all these names; templates read one of them.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(KilnError, ValueError):
    """The messages cannot be rendered: malformed content, or the template rejected them."""

    def __init__(self, message: str, *, param: str | None = "messages", hint: str | None = None) -> None:
        super().__init__(
            400,
            "invalid_messages",
            message,
            param=param,
            hint=hint or "Fix the messages so the model's chat template accepts them.",
        )


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.source = source
        self.special_tokens = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v}
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"The chat template does not compile: {e.message} (line {e.lineno})") from e

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        context = {
            **self.special_tokens,
            **template_kwargs,
            "messages": normalize_messages(messages),
            "tools": [_plain(t) for t in tools] if tools else None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except _TemplateRaised as e:
            raise ChatTemplateError(e.message) from e
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            message = e.message if isinstance(e, jinja2.TemplateError) and e.message else str(e)
            raise ChatTemplateError(f"The chat template failed on these messages: {message}") from e


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain dicts the template can read: content a string, JSON-string tool arguments parsed,
    empty tool_calls and None-valued keys dropped (as transformers drops them)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be an array of message objects")
    out = []
    for index, raw in enumerate(messages):
        message = _plain(raw)
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{index}] must be an object", param=f"messages[{index}]")
        message["content"] = _content_text(message.get("content"), index)
        message = {k: v for k, v in message.items() if v is not None}
        if "tool_calls" in message:
            calls = message["tool_calls"]
            if not calls:
                del message["tool_calls"]
            else:
                message["tool_calls"] = _parse_tool_arguments(calls, index)
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    param = f"messages[{index}].content"
    if not isinstance(content, list):
        raise ChatTemplateError(
            f"messages[{index}].content must be a string, null or an array of content parts", param=param
        )
    texts = []
    for n, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ChatTemplateError(
                f'messages[{index}].content[{n}] must be an object with a "type"', param=f"{param}[{n}]"
            )
        if part["type"] not in TEXT_PART_TYPES:
            # The contract: non-text parts (images, audio, files) are ignored, not rejected.
            continue
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(
                f'messages[{index}].content[{n}] is a {part["type"]} part without a string "text"',
                param=f"{param}[{n}].text",
            )
        texts.append(text)
    return "".join(texts)


def _parse_tool_arguments(calls: Any, index: int) -> list[Any]:
    """JSON-string arguments become objects, so templates render them in their own format
    (as vLLM does); strings that are not a JSON object are left as they came."""
    if not isinstance(calls, list):
        raise ChatTemplateError(
            f"messages[{index}].tool_calls must be an array", param=f"messages[{index}].tool_calls"
        )
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except json.JSONDecodeError:
                arguments = None
            if isinstance(arguments, dict):
                call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return parsed


def _plain(value: Any) -> Any:
    """Only JSON data reaches the sandbox (pydantic models are dumped first)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump(exclude_none=True))
    return str(value)


# ---- the jinja environment --------------------------------------------------------------------


class _TemplateRaised(jinja2.TemplateError):
    """`raise_exception(...)` from inside a template: its message is the error message."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    only needs its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """transformers' namespace: no underscore-prefixed attributes (no reach into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 -- jinja's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"templates cannot set underscore attribute {name!r}")


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _TemplateDict()
    return env
