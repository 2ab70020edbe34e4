"""What every command line shares: argparse types for ports and counts, the token-list and prompt-file
readers, and a quiet exit when stdout is a closed pipe.

Values are checked where they are read, so a mistake is an argparse error naming the flag (exit 2)
instead of a silently different value (a port taken modulo 65,536, ``"1 2 3"`` read as 123) or a
traceback from deeper down (protobuf's ``Value out of range``)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "ID_BITS",
    "LOG_FORMAT_HELP",
    "LOG_LEVEL_HELP",
    "MAX_PORT",
    "SUBJECT_PREFIX_HELP",
    "PromptFileError",
    "count",
    "parse_ids",
    "port",
    "port_or_off",
    "positive",
    "quiet_broken_pipe",
    "read_prompts",
]

MAX_PORT = 65535

# Help texts of options several commands have, worded once.
SUBJECT_PREFIX_HELP = (
    "NATS subject prefix: workers publish on PREFIX.events.<worker> and PREFIX.status.<worker>; "
    "the index, shims and captures of one deployment use the same (default kvindex)"
)
LOG_FORMAT_HELP = "log lines as json, console (for people) or auto: console on a terminal, else json"
LOG_LEVEL_HELP = "lowest level logged: debug, info, warning or error (default info)"


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: any free port, where the command says so)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-{MAX_PORT})") from None
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-{MAX_PORT})")
    return value


def port_or_off(text: str) -> int:
    """A TCP port, or -1 for a listener that is off."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a port number (0-{MAX_PORT}, or -1: off)"
        ) from None
    if not -1 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-{MAX_PORT}, or -1: off)")
    return value


def _bounded(text: str, low: int, high: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{value} is out of range ({low} to {high})")
    return value


def count(text: str) -> int:
    """A whole number >= 0 that fits the API's uint32 fields (``--top-k``: 0 means all)."""
    return _bounded(text, 0, (1 << 32) - 1)


def positive(text: str) -> int:
    """A whole number >= 1 (and a uint32)."""
    return _bounded(text, 1, (1 << 32) - 1)


def non_negative(text: str) -> float:
    """A finite number >= 0 (seconds, MiB, weights)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def positive_number(text: str) -> float:
    """A finite number > 0 (a timeout, a window)."""
    value = non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


# -- token ids and block keys -----------------------------------------------------------------------

# What the API's fields hold (proto/kvindex/v1/kvindex.proto): token ids are uint32, keys uint64.
ID_BITS = {"token_ids": 32, "block_keys": 64}
_ID_NAMES = {"token_ids": "token ids", "block_keys": "block keys"}
_SEPARATORS = re.compile(r"[\s,]+")
_INTEGER = re.compile(r"-?[0-9]+")


def check_id(item: Any, field: str) -> int:
    """One token id or block key: an integer (JSON or text) in the field's range; ValueError naming it."""
    bits = ID_BITS[field]
    # JSON true/false and 1.5 are not ids; int(True) and int("1_0") would hide that.
    if isinstance(item, bool) or not (
        isinstance(item, int) or (isinstance(item, str) and _INTEGER.fullmatch(item))
    ):
        raise ValueError(f"{item!r} is not an integer")
    value = int(item)
    if not 0 <= value < 1 << bits:
        raise ValueError(
            f"{value} is out of range: {_ID_NAMES[field]} are unsigned {bits}-bit integers "
            f"(0 to {(1 << bits) - 1})"
        )
    return value


def parse_ids(text: str, field: str) -> list[int]:
    """``"1,2,3"``, ``"1 2 3"`` or ``"1, 2 3"``: ids separated by commas and/or whitespace (digits are
    never joined); ValueError naming the first item that is not an id in range, or an empty list."""
    out = [check_id(item, field) for item in _SEPARATORS.split(text.strip()) if item]
    if not out:
        raise ValueError(f"no {_ID_NAMES[field]} given")
    return out


# -- prompt files -----------------------------------------------------------------------------------


class PromptFileError(ValueError):
    """A prompt file that cannot be read, or holds no prompt: the message names the file."""


def read_prompts(path: str) -> list[dict[str, Any]]:
    """The prompts of a prompt file (``prompt.json``), in every shape the tools write or take:

    - an object, ``{"model": "m", "token_ids": [1, 2, 3]}`` (``make sample-log``'s, what ``kvindex
      replay --query`` ranks; also ``block_keys`` instead of ``token_ids``, and ``lora``, ``salt`` and
      the query options of replay);
    - a list of such objects;
    - a bare list of token ids, ``[1, 2, 3]``: one prompt with ``token_ids`` and no model.

    ``token_ids`` and ``block_keys`` are checked as on the command line."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PromptFileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"{path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{path}: not JSON ({exc})") from None
    shape = (
        'expected a prompt object ({"model": ..., "token_ids": [...]}), a list of them, or a list '
        "of token ids"
    )
    if isinstance(data, dict):
        prompts = [data]
    elif isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        prompts = data
    elif isinstance(data, list) and data and not any(isinstance(x, dict | list) for x in data):
        prompts = [{"token_ids": data}]
    else:
        raise PromptFileError(f"{path}: {shape}" + ("; it is an empty list" if data == [] else ""))
    for i, prompt in enumerate(prompts):
        where = path if len(prompts) == 1 else f"{path}[{i}]"
        for field in ID_BITS:
            if field not in prompt:
                continue
            ids = prompt[field]
            if not isinstance(ids, list):
                raise PromptFileError(f"{where}: {field} must be a list of integers")
            try:
                prompt[field] = [check_id(x, field) for x in ids]
            except ValueError as exc:
                raise PromptFileError(f"{where}: {field}: {exc}") from None
    return prompts


# -- output -----------------------------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., int])


def quiet_broken_pipe(main: F) -> F:
    """``main`` of a command that prints: when its reader goes away (``kvindex instances | head``) it
    stops quietly with status 141, what a shell reports for a Unix tool killed by SIGPIPE, instead of
    a BrokenPipeError traceback. (Python ignores SIGPIPE, so the write raises; restoring the default
    action instead would let a closed client socket kill a server.)"""

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> int:
        try:
            code = main(*args, **kwargs)
            if sys.stdout is not None:  # None: started with stdout closed
                sys.stdout.flush()  # what is still buffered meets the closed pipe here, not at exit
            return code
        except BrokenPipeError:
            # The interpreter flushes stdout once more at exit and would report that failure too.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return 128 + signal.SIGPIPE

    return wrapper  # type: ignore[return-value]
