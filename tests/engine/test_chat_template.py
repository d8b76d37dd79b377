"""ChatTemplate renders exactly what transformers' apply_chat_template renders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kiln.engine.chat_template import ChatTemplate, ChatTemplateError
from kiln.errors import KilnError
from kiln.testing.tiny import make_tiny_model, qwen3_chat_template

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather ☀ in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I need the tool.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "c2", "content": "second result"},
]

CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nplanning\n</think>\n\nHello!"},
    {"role": "user", "content": "Bye"},
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """transformers' tokenizer of a tiny Qwen3-style model; its template is swapped per test."""
    transformers = pytest.importorskip("transformers")
    model_dir: Path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def _reference_render(ref: Any, template: str, messages: list, **kwargs: Any) -> str:
    ref.chat_template = template
    return ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("messages", [CHAT, [{"role": "system", "content": "S"}, *CHAT]])
def test_smollm2_template_matches_transformers(reference: Any, messages: list) -> None:
    ours = ChatTemplate(SMOLLM2_TEMPLATE, "<|im_start|>", "<|im_end|>").render(messages)
    assert ours == _reference_render(reference, SMOLLM2_TEMPLATE, messages)


@pytest.mark.parametrize("thinking_prompt", [False, True])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("messages", [CHAT, TOOL_CONVERSATION])
def test_qwen3_template_matches_transformers(
    reference: Any, messages: list, tools: list | None, kwargs: dict, thinking_prompt: bool
) -> None:
    source = qwen3_chat_template(thinking_prompt=thinking_prompt)
    ours = ChatTemplate(source, None, "<|im_end|>").render(messages, tools=tools, **kwargs)
    assert ours == _reference_render(reference, source, messages, tools=tools, **kwargs)


def test_qwen3_renders_tools_block_and_tool_round_trip() -> None:
    text = ChatTemplate(qwen3_chat_template()).render(TOOL_CONVERSATION, tools=TOOLS)
    assert "# Tools" in text and "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>' in text
    assert "<think>\nI need the tool.\n</think>" in text


def test_qwen3_generation_prompt_with_thinking_disabled_has_empty_think_block() -> None:
    text = ChatTemplate(qwen3_chat_template()).render(CHAT, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_generation_prompt_leaves_thinking_to_the_model_by_default() -> None:
    assert ChatTemplate(qwen3_chat_template()).render(CHAT).endswith("<|im_start|>assistant\n")


def test_thinking_prompt_variant_opens_a_think_block() -> None:
    text = ChatTemplate(qwen3_chat_template(thinking_prompt=True)).render(CHAT)
    assert text.endswith("<|im_start|>assistant\n<think>\n")


def test_no_generation_prompt_when_not_asked() -> None:
    text = ChatTemplate(qwen3_chat_template()).render(CHAT, add_generation_prompt=False)
    assert text.endswith("Bye<|im_end|>\n")


def test_json_string_tool_arguments_render_like_objects() -> None:
    as_string = json.loads(json.dumps(TOOL_CONVERSATION))
    as_string[2]["tool_calls"][0]["function"]["arguments"] = '{"city":"Zürich"}'
    t = ChatTemplate(qwen3_chat_template())
    assert t.render(as_string, tools=TOOLS) == t.render(TOOL_CONVERSATION, tools=TOOLS)


def test_empty_tool_calls_are_dropped() -> None:
    t = ChatTemplate("{% for m in messages %}{{ 'tool_calls' in m }}{% endfor %}")
    assert t.render([{"role": "assistant", "content": "x", "tool_calls": []}]) == "False"


def test_text_parts_are_concatenated_and_other_parts_ignored() -> None:
    content = [
        {"type": "text", "text": "Hello "},
        {"type": "image_url", "image_url": {"url": "data:,"}},
        {"type": "input_text", "text": "wor"},
        {"type": "output_text", "text": "ld"},
    ]
    assert (
        ChatTemplate("{{ messages[0].content }}").render([{"role": "user", "content": content}])
        == "Hello world"
    )


def test_null_content_renders_as_empty_string() -> None:
    text = ChatTemplate(SMOLLM2_TEMPLATE).render(
        [{"role": "user", "content": None}], add_generation_prompt=False
    )
    assert text.endswith("<|im_start|>user\n<|im_end|>\n")


def test_malformed_content_part_names_the_message_index() -> None:
    messages = [{"role": "user", "content": "ok"}, {"role": "user", "content": [{"text": "no type"}]}]
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]") as info:
        ChatTemplate(SMOLLM2_TEMPLATE).render(messages)
    assert info.value.param == "messages[1].content[0]"


def test_text_part_without_text_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]"):
        ChatTemplate(SMOLLM2_TEMPLATE).render([{"role": "user", "content": [{"type": "text"}]}])


def test_content_of_another_type_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"messages\[0\]\.content must be"):
        ChatTemplate(SMOLLM2_TEMPLATE).render([{"role": "user", "content": 42}])


def test_raise_exception_becomes_a_400_with_the_templates_message() -> None:
    t = ChatTemplate("{{ raise_exception('Conversation roles must alternate user/assistant') }}")
    with pytest.raises(ChatTemplateError) as info:
        t.render(CHAT)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, KilnError)
    assert (err.status, err.code, err.message) == (
        400,
        "invalid_messages",
        "Conversation roles must alternate user/assistant",
    )


def test_template_runtime_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="chat template failed"):
        ChatTemplate("{{ messages[0].content + 1 }}").render(CHAT)


def test_template_syntax_error_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_sandbox_blocks_reaching_python_internals() -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__subclasses__() }}").render(CHAT)


def test_tojson_keeps_unicode_and_supports_indent() -> None:
    t = ChatTemplate("{{ tools[0] | tojson }}|{{ tools[0] | tojson(indent=2) }}")
    tool = {"name": "café"}
    assert t.render(CHAT, tools=[tool]) == '{"name": "café"}|' + json.dumps(
        tool, ensure_ascii=False, indent=2
    )


def test_special_tokens_and_template_kwargs_are_visible() -> None:
    t = ChatTemplate("{{ bos_token }}{{ eos_token }}{{ custom }}", "<s>", "</s>")
    assert t.render(CHAT, custom="!") == "<s></s>!"


def test_strftime_now_loopcontrols_and_generation_blocks_work() -> None:
    t = ChatTemplate(
        "{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert t.render(CHAT) == "4Hi"


def test_reasoning_aliases_fill_reasoning_content() -> None:
    t = ChatTemplate("{{ messages[0].reasoning_content }}")
    assert t.render([{"role": "assistant", "content": "x", "reasoning": "why"}]) == "why"


def test_pydantic_like_messages_are_accepted() -> None:
    class Message:
        def model_dump(self, exclude_none: bool = False) -> dict:
            return {"role": "user", "content": "from a model"}

    assert ChatTemplate("{{ messages[0].content }}").render([Message()]) == "from a model"
