"""A small conversation corpus that gives every strategy, target kind and skip counter something to do."""

from __future__ import annotations

from typing import Any

WEATHER_CALL = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
XML_CALL = "<tool_call>\n<function=run_shell>\n<parameter=command>\nls /tmp\n</parameter>\n</function>\n</tool_call>"
SKY = ("Sunlight scatters off nitrogen molecules in the atmosphere.\n"
       "Shorter blue wavelengths scatter far more strongly than longer red wavelengths.")


def corpus() -> list[Any]:
    return [
        {"messages": [{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": "What is 2 + 2?"},
                      {"role": "assistant", "content": "4"}],
         "group_id": "arith"},
        {"messages": [{"role": "user", "content": "Which is a primary colour? A) green B) blue"},
                      {"role": "assistant", "content": "(B)"}]},
        {"messages": [{"role": "user", "content": "What's the weather in Paris?"},
                      {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"sunny\"}"},
                      {"role": "assistant", "content": "It is 21 degrees and sunny in Paris."}]},
        {"messages": [{"role": "user", "content": "Write a function that adds two numbers."},
                      {"role": "assistant", "content": "Sure:\n```py\ndef add(a, b):\n    return a + b\n```"}]},
        {"messages": [{"role": "user", "content": "Give me a JSON object naming Ada."},
                      {"role": "assistant", "content": "{\"name\": \"Ada\"}"},
                      {"role": "user", "content": "Why is the sky blue?"},
                      {"role": "assistant", "content": SKY}],
         "metadata": {"source": "science"}},
        {"messages": [{"role": "user", "content": "List the files in /tmp."},
                      {"role": "assistant", "content": XML_CALL},
                      {"role": "tool", "content": "a.txt\nb.txt"},
                      {"role": "assistant", "content": "There are two files: a.txt and b.txt."}]},
        {"messages": [{"role": "user", "content": "Nobody answers this one."}]},
        {"messages": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": "  "}]},
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]},
        "not a conversation",
    ]


def numbered(n: int) -> list[dict[str, Any]]:
    """n distinct one-turn conversations: "Question i?" -> "Answer i"."""
    return [{"messages": [{"role": "user", "content": f"Question {i}?"},
                          {"role": "assistant", "content": f"Answer {i}"}]} for i in range(n)]
