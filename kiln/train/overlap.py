"""Does a held-out eval suite overlap the training rows? (semantics.md §8.14) Pure: no model, no I/O.

An example overlaps when any of these holds against any training row:
- its prompt equals a training prompt, exactly or after case/whitespace normalization, also with the
  leading system message(s) removed and with trailing tool results removed (on either side). A
  training prompt is every conversation prefix before an assistant turn (SFT) or the group's
  messages (GRPO). The prompt is the key: an example whose prompt was trained on is not held out,
  whatever its target; equal targets alone (a "4" or an "A") are not evidence of a leak.
- its metadata names a source row (`kiln_dataset_provenance.row_identity`, `row_identity` or
  `source_row_identity`) whose exact or normalized content identity is a training row's;
- it shares a group_id or session_id with a training row (root field or inside metadata,
  provenance, extra -- the same places the dataset split looks).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.data.identity import content_sha256, normalize_text, normalize_value, normalized_sha256, row_link_id
from kiln.evals.suite import EvalSuite, example_id, prompt_messages
from kiln.store.atomic import canonical_json

LINK_KEYS = ("group_id", "session_id")
SYNTHESIS_PROVENANCE = "kiln_dataset_provenance"


@dataclass(frozen=True)
class Overlap:
    example_id: str
    row_label: str   # how the training row is named in errors: "examples[3]", "dataset 'qa' (train) row 3"
    reason: str


def _text(content: Any) -> Any:
    return content if isinstance(content, str) else ("" if content is None else content)


def _message_key(m: Mapping[str, Any], normalized: bool) -> list[Any]:
    role, text, calls = str(m.get("role", "")), _text(m.get("content")), m.get("tool_calls")
    if normalized:
        role = role.strip().lower()
        text = normalize_text(text) if isinstance(text, str) else normalize_value(text)
        calls = normalize_value(calls)
    return [role, text, calls]


def _variants(messages: Sequence[Mapping[str, Any]]) -> Iterator[Sequence[Mapping[str, Any]]]:
    """The prompt as given, without leading system messages, without trailing tool results, and both."""
    start = 0
    while start < len(messages) and messages[start].get("role") == "system":
        start += 1
    end = len(messages)
    while end > start and messages[end - 1].get("role") == "tool":
        end -= 1
    for lo, hi in {(0, len(messages)), (start, len(messages)), (0, end), (start, end)}:
        if hi > lo:
            yield messages[lo:hi]


def prompt_keys(messages: Sequence[Mapping[str, Any]]) -> set[tuple[str, bytes]]:
    """Exact and normalized keys of every variant of one prompt."""
    keys = set()
    for variant in _variants(messages):
        keys.add(("exact", canonical_json([_message_key(m, False) for m in variant])))
        keys.add(("normalized", canonical_json([_message_key(m, True) for m in variant])))
    return keys


def training_prompts(row: Any) -> list[list[Mapping[str, Any]]]:
    """GRPO: the group's messages. SFT: each prefix that ends right before an assistant turn (the whole
    conversation when it has no assistant turn)."""
    if not isinstance(row, Mapping) or not isinstance(row.get("messages"), list):
        return []
    messages = [m for m in row["messages"] if isinstance(m, Mapping)]
    if "completions" in row:
        return [messages]
    prefixes = [messages[:i] for i, m in enumerate(messages) if m.get("role") == "assistant" and i > 0]
    return prefixes or [messages]


def _source_rows(metadata: Any) -> list[str]:
    if not isinstance(metadata, Mapping):
        return []
    found = [metadata.get("row_identity"), metadata.get("source_row_identity")]
    synth = metadata.get(SYNTHESIS_PROVENANCE)
    if isinstance(synth, Mapping):
        found.append(synth.get("row_identity"))
    return [f for f in found if isinstance(f, str) and f]


class TrainingIndex:
    """Everything about the training rows an eval example could collide with, keyed for lookup."""

    def __init__(self, rows: Sequence[Any], labels: Sequence[str]) -> None:
        self.prompts: dict[tuple[str, bytes], str] = {}
        self.identities: dict[str, str] = {}
        self.links: dict[tuple[str, str], str] = {}
        for row, label in zip(rows, labels, strict=True):
            for prompt in training_prompts(row):
                for key in prompt_keys(prompt):
                    self.prompts.setdefault(key, label)
            for identity in (content_sha256(row), normalized_sha256(row)):
                self.identities.setdefault(identity, label)
            for key in LINK_KEYS:
                link = row_link_id(row, key)
                if link is not None:
                    self.links.setdefault((key, link), label)

    def match(self, messages: Sequence[Mapping[str, Any]], metadata: Any) -> tuple[str, str] | None:
        """(training row label, reason) of the first collision, or None."""
        for kind, key in sorted(prompt_keys(messages)):
            label = self.prompts.get((kind, key))
            if label is not None:
                how = "exactly" if kind == "exact" else "after case/whitespace normalization"
                return label, f"its prompt matches a training prompt {how}"
        for identity in _source_rows(metadata):
            label = self.identities.get(identity)
            if label is not None:
                return label, f"its source row {identity} is a training row"
        if isinstance(metadata, Mapping):
            for key in LINK_KEYS:
                link = row_link_id(metadata, key)
                if link is not None and (key, link) in self.links:
                    return self.links[(key, link)], f"it shares {key} {link!r} with a training row"
        return None


def find_overlaps(suite: EvalSuite, rows: Sequence[Any], labels: Sequence[str]) -> list[Overlap]:
    """Every example of `suite` that overlaps the training rows, in suite order."""
    index = TrainingIndex(rows, labels)
    out = []
    for ex in suite.examples:
        # The prompt as the eval sends it (suite system prompt included) and as the example wrote it.
        for messages in (prompt_messages(suite, ex), [m.to_dict() for m in ex.messages]):
            hit = index.match(messages, ex.metadata)
            if hit is not None:
                out.append(Overlap(example_id(ex), hit[0], hit[1]))
                break
    return out
