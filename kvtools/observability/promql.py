"""The metric names a PromQL expression reads, without a PromQL parser: enough for the expressions of
our dashboards and rules, checked against what the processes export (tests/unit/test_observability.py)
and, for syntax, by a real Prometheus (make e2e-observability).

What is not a metric name: string literals, label matchers ``{...}``, range and subquery selectors
``[...]``, grouping label lists (``by``, ``without``, ``on``, ``ignoring``, ``group_left``,
``group_right``), function and aggregation names (an identifier before ``(``), keywords, numbers,
durations after ``offset``, and dashboard variables (``$name``).
"""

from __future__ import annotations

import re

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_OFFSET = re.compile(r"\boffset\s+-?[0-9a-zA-Z_$]+")
_VARIABLE = re.compile(r"\$\{?\w+\}?")
_NUMBER = re.compile(r"(?<![\w:])(?:0x[0-9a-fA-F]+|[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)(?![\w:])")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"offset", "inf", "nan", "Inf", "NaN"}
)


def metric_names(expr: str) -> set[str]:
    """Every metric name ``expr`` selects."""
    text = _STRING.sub(" ", expr)
    text = _BRACES.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    text = _VARIABLE.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        name = m.group()
        rest = text[m.end() :].lstrip()
        if rest.startswith("(") or name in KEYWORDS:
            continue  # a function or aggregation, or a keyword
        names.add(name)
    return names
