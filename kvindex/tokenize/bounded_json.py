"""JSON from requests, with a nesting limit: chat ``messages``, ``tools``, ``documents``,
``chat_template_kwargs``, tool-call ``arguments`` and whole OpenAI bodies.

Python's json module recurses once per level and raises ``RecursionError`` near 1,000 levels, fewer
the deeper the caller's stack; rendering a chat template recurses again over what it renders
(``tojson``, loops over content parts). Unchecked, ``"[" * 5000`` in a prompt field escaped as an
internal error. Here anything nested deeper than ``MAX_JSON_DEPTH`` is refused with a ``TooDeep`` (a
``ValueError``) naming the field and the limit, whatever the stack. 128 is serde_json's default
limit; chats, tool schemas and template arguments stay far below it (a tool's JSON Schema is rarely
10 deep).
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 128


class TooDeep(ValueError):
    """JSON nested deeper than ``MAX_JSON_DEPTH``; the message names what was parsed."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels (the JSON depth limit)")


def loads(text: str | bytes, what: str) -> Any:
    """``json.loads(text)``; TooDeep when nested deeper than MAX_JSON_DEPTH (other errors: json's)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(what) from None
    # A value cannot be deeper than its text has opening brackets: most texts need no walk (counting
    # is C speed, the walk Python's).
    if isinstance(text, str):
        opening = text.count("[") + text.count("{")
    else:
        opening = text.count(b"[") + text.count(b"{")
    if opening > MAX_JSON_DEPTH:
        check_depth(value, what)
    return value


def check_depth(value: Any, what: str) -> None:
    """TooDeep when ``value`` (lists and dicts, as json makes them) nests deeper than the limit.
    Iterative: a value too deep for the limit is not too deep for this check."""
    stack = [(value, 1)] if type(value) in (list, dict) else []
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise TooDeep(what)
        for child in item.values() if type(item) is dict else item:
            if type(child) in (list, dict):
                stack.append((child, depth + 1))
