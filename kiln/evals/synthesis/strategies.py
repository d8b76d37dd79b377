"""The six ways a conversation is decomposed into eval candidates (semantics.md §10.3).

A candidate is a prompt (the messages before an assistant turn) plus that turn's target, or None
when the strategy picked a turn with nothing gradable (the pipeline counts it as skipped_no_target).
An empty list means the strategy does not apply to the conversation (skipped_strategy_match).
Trailing tool messages are trimmed off prompts, except for tool_response_followup, whose whole
point is answering from the tool results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.evals.synthesis.config import Strategy
from kiln.evals.synthesis.targets import Target, extract_target

Message = dict[str, Any]


@dataclass(frozen=True)
class Candidate:
    prompt: list[Message]
    turn: int  # index of the graded assistant message in the conversation
    target: Target | None
    tags: tuple[str, ...]  # strategy tags; the pipeline adds the kind and language tags


def _role(msg: Message) -> str:
    return msg.get("role", "")


def _trim_tools(messages: list[Message]) -> list[Message]:
    end = len(messages)
    while end > 0 and _role(messages[end - 1]) == "tool":
        end -= 1
    return messages[:end]


def _assistant_turns(messages: list[Message], start: int = 0) -> list[int]:
    return [i for i in range(start, len(messages)) if _role(messages[i]) == "assistant"]


def _turn(messages: list[Message], i: int, tags: tuple[str, ...], *, trim: bool = True) -> Candidate | None:
    """The candidate for assistant turn `i`, or None when its prompt would be empty."""
    prompt = _trim_tools(messages[:i]) if trim else messages[:i]
    if not prompt:
        return None
    return Candidate(prompt, i, extract_target(messages[i]), tags)


def _first_usable(messages: list[Message], turns: list[int], tags: tuple[str, ...]) -> list[Candidate]:
    """The first turn with a target; when none has one, the first turn (reported as having no target)."""
    fallback: Candidate | None = None
    for i in turns:
        c = _turn(messages, i, tags)
        if c is None:
            continue
        if c.target is not None:
            return [c]
        fallback = fallback or c
    return [fallback] if fallback is not None else []


def final_assistant(messages: list[Message]) -> list[Candidate]:
    return _first_usable(messages, _assistant_turns(messages)[::-1], ("synth:final_assistant",))


def first_assistant_turn(messages: list[Message]) -> list[Candidate]:
    first_user = next((i for i, m in enumerate(messages) if _role(m) == "user"), None)
    if first_user is None:
        return []
    return _first_usable(messages, _assistant_turns(messages, first_user + 1), ("synth:first_assistant",))


def every_assistant_turn(messages: list[Message]) -> list[Candidate]:
    out = []
    for i in _assistant_turns(messages):
        c = _turn(messages, i, ("synth:every_assistant", f"synth:turn_{i}"))
        if c is not None:
            out.append(c)
    return out


def tool_call_predict(messages: list[Message]) -> list[Candidate]:
    out = []
    for i in _assistant_turns(messages):
        c = _turn(messages, i, ("synth:tool_call_predict", f"synth:turn_{i}"))
        if c is not None and c.target is not None and c.target.kind == "tool_call":
            out.append(c)
    return out


def _calls_tools(msg: Message) -> bool:
    calls = msg.get("tool_calls")
    if isinstance(calls, list) and calls:
        return True
    target = extract_target(msg)
    return target is not None and target.kind == "tool_call"


def tool_response_followup(messages: list[Message]) -> list[Candidate]:
    """Each assistant turn that answers right after tool results its own tool call asked for."""
    out = []
    for i in _assistant_turns(messages):
        if not _calls_tools(messages[i]):
            continue
        j = i + 1
        while j < len(messages) and _role(messages[j]) == "tool":
            j += 1
        if j == i + 1 or j >= len(messages) or _role(messages[j]) != "assistant":
            continue
        c = _turn(messages, j, ("synth:tool_response_followup", f"synth:turn_{j}"), trim=False)
        if c is not None:
            out.append(c)
    return out


def end_of_trajectory_answer(messages: list[Message]) -> list[Candidate]:
    last_tool = max((i for i, m in enumerate(messages) if _role(m) == "tool"), default=None)
    if last_tool is None:
        return []
    turns = _assistant_turns(messages, last_tool + 1)
    if not turns:
        return []
    c = _turn(messages, turns[0], ("synth:end_of_trajectory",))
    return [c] if c is not None else []


STRATEGIES: dict[str, Callable[[list[Message]], list[Candidate]]] = {
    "final_assistant": final_assistant,
    "first_assistant_turn": first_assistant_turn,
    "every_assistant_turn": every_assistant_turn,
    "tool_call_predict": tool_call_predict,
    "tool_response_followup": tool_response_followup,
    "end_of_trajectory_answer": end_of_trajectory_answer,
}


def decompose(messages: list[Message], strategy: Strategy) -> list[Candidate]:
    return STRATEGIES[strategy](messages)
