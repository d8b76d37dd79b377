"""Cheap, deterministic text similarity used by argument scoring and scorer auto-detection."""

from __future__ import annotations

import re

_WORD_RE = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_CODE_TOKEN_SPLIT_RE = re.compile(r"[^A-Za-z0-9_.]+")
# Only words of 4+ characters can be content words, so shorter stopwords need not be listed.
_STOPWORD_TEXT = """
    about above after again against also because been before being below between both could does
    doing down during each from further have having here hers herself himself into itself just more
    most myself once only other ours ourselves over same should some such than that their theirs
    them themselves then there these they this those through under until very were what when where
    which while whom will with would your yours yourself yourselves shall must might onto upon whose
"""
STOPWORDS = frozenset(_STOPWORD_TEXT.split())


def content_words(text: str) -> list[str]:
    """Lowercased words of at least 4 characters that are not stopwords."""
    return [w for w in _WORD_RE.findall(text.lower()) if len(w) >= 4 and w not in STOPWORDS]


def key_phrases(text: str, limit: int) -> list[str]:
    """Up to `limit` non-overlapping 3-word phrases of content words, in reading order."""
    words = content_words(text)
    phrases: list[str] = []
    for i in range(0, len(words) - 2, 3):
        phrase = " ".join(words[i:i + 3])
        if phrase not in phrases:
            phrases.append(phrase)
        if len(phrases) == limit:
            break
    return phrases


def char_jaccard(a: str, b: str) -> float:
    sa = {c for c in a.lower() if not c.isspace()}
    sb = {c for c in b.lower() if not c.isspace()}
    if not sa and not sb:
        return 1.0
    return len(sa & sb) / len(sa | sb)


def phrase_similarity(target: str, predicted: str, limit: int = 5) -> float:
    """Fraction of the target's key phrases found in the prediction (+0.05, capped), else char Jaccard."""
    phrases = key_phrases(target, limit)
    if not phrases:
        return char_jaccard(target, predicted)
    haystack = " ".join(content_words(predicted))
    found = sum(1 for p in phrases if p in haystack)
    return min(1.0, found / len(phrases) + 0.05)


def code_tokens(code: str) -> set[str]:
    """Identifier-ish tokens (split on anything but alnum, '_' and '.') of at least 2 characters."""
    return {t for t in _CODE_TOKEN_SPLIT_RE.split(code) if len(t) >= 2}


def jaccard(a: set[str], b: set[str]) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)
