"""Encoding text piecewise, so that repeated pieces (system prompts, earlier turns) are encoded once.

A tokenizer first cuts special tokens out of the text (its added-vocabulary pass), then normalizes,
pre-tokenizes and runs BPE on each piece between them separately: no merge crosses a special token.
So ``encode(a + S + b) == encode(a + S) + encode(b)`` whenever ``S`` is a special token that the
added-vocabulary pass is sure to match where it stands, and whose matching does not depend on what
follows it. The pieces between such boundaries can be encoded once and cached by their text; a growing
chat then re-encodes only its new turns.

What breaks the rule, and how each case is kept out:

- ``rstrip``/``lstrip``/``single_word`` special tokens swallow or look at neighbouring whitespace;
  ``normalized`` ones are matched after normalization: not used as boundaries.
- A special token that another added token contains or overlaps (suffix of one = prefix of the other)
  may be matched differently in context: not used.
- Pipelines whose output depends on a piece being the first of the text (``Metaspace`` with
  ``prepend_scheme: first``, as in Llama 2 and Mistral's tokenizers) or any other context: every
  candidate boundary is *probed* at load time on sample texts around it, with and without a split, and
  dropped if any probe differs. Such tokenizers simply get no boundaries and encode whole texts (still
  cached as a whole).
- The post-processor (BOS/EOS) is applied once around the joined pieces: its additions are learned by
  encoding probes with and without special tokens; if they are not a fixed prefix/suffix, texts that
  need them are encoded directly.

Plain text is also cut at line starts: right after a newline that is followed by a letter. In the
pre-tokenizer regexes of byte-level BPE tokenizers (GPT-2, Llama 3, Qwen 2 and their kin) no
pre-token can contain a newline followed by a letter (a letter run may take one leading character,
but never a newline; whitespace and newline runs end before letters), and BPE never merges across
pre-tokens, so a line start is a boundary whatever surrounds it. A document inside a user message, or
a completions prompt sharing its first lines with an earlier one, is then encoded once per line. This
too is probed per model (a normalizer that strips, Metaspace prefixes, ...) and refused when an added
token contains a newline or could swallow one (``lstrip`` and starting with a letter).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

# Texts put around a candidate boundary when probing it: leading spaces, newlines, words, digits,
# punctuation, non-ASCII, and the boundary token again.
PROBE_LEFT = ("", "hello world", "a\n\n", "x ", "12")
PROBE_RIGHT = (
    "hello",
    " hello world",
    "\n\nThe",
    "  two spaces",
    "user",
    "\tTab",
    "12 34",
    "é café 東京",
    "'s it",
    "",
)


def _ids(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special).ids)


def boundary_tokens(tokenizer: Any) -> list[str]:
    """Special tokens after which the text can be cut without changing its encoding (see module doc)."""
    if getattr(tokenizer, "encode_special_tokens", False):
        return []  # special tokens are encoded as text: no added-vocabulary pass to rely on
    added = tokenizer.get_added_tokens_decoder()
    contents = [t.content for t in added.values() if t.content]
    candidates = []
    for tok in added.values():
        s = tok.content
        if not (s and tok.special) or tok.normalized or tok.lstrip or tok.rstrip or tok.single_word:
            continue
        if any(_overlaps(s, other) for other in contents if other != s) or _self_overlaps(s):
            continue
        candidates.append(s)
    return [s for s in candidates if _probe(tokenizer, s, candidates)]


def _overlaps(s: str, other: str) -> bool:
    """Could ``other`` be matched over (part of) an occurrence of ``s``?"""
    if s in other:
        return True
    n = min(len(s), len(other))
    return any(other.endswith(s[:k]) or s.endswith(other[:k]) for k in range(1, n))


def _self_overlaps(s: str) -> bool:
    return any(s[:k] == s[-k:] for k in range(1, len(s)))


def _probe(tokenizer: Any, s: str, others: list[str]) -> bool:
    rights = [*PROBE_RIGHT, s + "x", f" {s}", *(o + " y" for o in others[:4])]
    for left in PROBE_LEFT:
        head = _ids(tokenizer, left + s)
        for right in rights:
            if _ids(tokenizer, left + s + right) != head + _ids(tokenizer, right):
                return False
    return True


# A newline followed by a letter ([^\W\d_] is a Unicode letter); the cut is after the newline.
LINE_START = r"\n(?=[^\W\d_])"
TEXT_LEFT = ("", "hello", "a b\n", "x  ", "  \n", "end.", "12", "東京", "\t", "'s", "<|", "é")
TEXT_RIGHT = ("Hello world", "the\n\nx", "a", "東京 x", "é", "Zebra  12", "x\ny", "s it")


def line_starts_safe(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` encodes text cut at line starts (see the module doc) as the whole."""
    if getattr(tokenizer, "encode_special_tokens", False):
        return False
    for tok in tokenizer.get_added_tokens_decoder().values():
        text = tok.content
        if "\n" in text or (tok.lstrip and text[:1].isalpha()):
            return False
    for left in TEXT_LEFT:
        head = _ids(tokenizer, left + "\n")
        for right in TEXT_RIGHT:
            if _ids(tokenizer, left + "\n" + right) != head + _ids(tokenizer, right):
                return False
    return True


def boundary_pattern(tokens: list[str], line_starts: bool = False) -> re.Pattern[str] | None:
    """A pattern whose matches end where a text may be cut: after the boundary tokens, and after
    newlines that start a line of text when ``line_starts``."""
    if not tokens and not line_starts:
        return None
    # Longest first, so that a token that is a prefix of another never shadows it.
    parts = [re.escape(t) for t in sorted(tokens, key=len, reverse=True)]
    if line_starts:
        parts.append(LINE_START)
    return re.compile("|".join(parts))


def special_wrap(tokenizer: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """(prefix, suffix) the post-processor adds around any text, or None if it is not that simple."""
    wrap = None
    for probe in ("hello world", "a\nb  c 12", "x"):
        raw = _ids(tokenizer, probe)
        full = _ids(tokenizer, probe, special=True)
        if not raw:
            return None
        found = None
        for i in range(len(full) - len(raw) + 1):
            if full[i : i + len(raw)] == raw:
                found = (tuple(full[:i]), tuple(full[i + len(raw) :]))
                break
        if found is None or (wrap is not None and found != wrap):
            return None
        wrap = found
    assert wrap is not None
    return np.array(wrap[0], dtype=np.uint32), np.array(wrap[1], dtype=np.uint32)


def split(text: str, pattern: re.Pattern[str] | None) -> list[str]:
    """``text`` cut right after every boundary token; the pieces join back to ``text``."""
    if pattern is None:
        return [text]
    pieces = []
    start = 0
    for m in pattern.finditer(text):
        end = m.end()
        pieces.append(text[start:end])
        start = end
    if start < len(text) or not pieces:
        pieces.append(text[start:])
    return pieces
