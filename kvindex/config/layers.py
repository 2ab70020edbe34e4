"""Command-line options from three layers: the command line, then the environment, then a TOML file.

Every long option of a command can be given three ways; the first that sets it wins:

1. the command line: ``--nats-creds /etc/kv/index.creds``
2. the environment: ``KVINDEX_`` + the option's longest name in upper case with dashes as
   underscores: ``KVINDEX_NATS_CREDS=/etc/kv/index.creds`` (``--nats``/``--nats-url`` is
   ``KVINDEX_NATS_URL``)
3. the TOML file named by ``--config FILE`` (every command gets the option) or ``KVINDEX_CONFIG``:
   keys are the option names without the dashes (``nats-creds = "/etc/kv/index.creds"``,
   ``nats-url = ["tls://a:4222", "tls://b:4222"]``); a table named after the command (``[serve]``,
   ``[vllm]``) overrides the top level for that command.

Booleans (``store_true``) take ``1/true/yes/on`` or ``0/false/no/off`` from the environment and
``true``/``false`` in TOML; repeatable options take a comma-separated string or a TOML list. Values go
through the option's own type and choices, so a bad value gets the same error as on the command line.
Options of a mutually exclusive group, positional arguments, ``store_const``/``count`` options and
``--help`` are command-line only.
A TOML key that names no option of any command is an error (a typo must not be ignored silently).

This is generic: an option added to any command parsed by :func:`parse_layered` is layered without
further work (the gRPC TLS options, for instance).
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ENV_PREFIX = "KVINDEX_"
CONFIG_OPTION = "--config"

_UNSET = object()  # marks "not given on the command line" during the first parse
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` on ``parser`` (once): the TOML layer."""
    if any(CONFIG_OPTION in a.option_strings for a in parser._actions):
        return
    parser.add_argument(
        CONFIG_OPTION,
        metavar="FILE",
        default=None,
        help="TOML file with option values (keys are option names; env KVINDEX_<OPTION> and the command "
        "line take precedence)",
    )


def env_name(action: argparse.Action) -> str:
    return ENV_PREFIX + _canonical(action).upper().replace("-", "_")


def _canonical(action: argparse.Action) -> str:
    longs = [s[2:] for s in action.option_strings if s.startswith("--")]
    return max(longs, key=len)


def _layerable(action: argparse.Action, exclusive: set[int]) -> bool:
    if not any(s.startswith("--") for s in action.option_strings):
        return False
    if isinstance(action, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction):
        return False
    if CONFIG_OPTION in action.option_strings:
        return False
    # Constant-storing and counting options have no value to read from text (store_true/false do).
    if isinstance(action, argparse._CountAction | argparse._AppendConstAction) or (
        isinstance(action, argparse._StoreConstAction) and not _is_flag(action)
    ):
        return False
    return id(action) not in exclusive


def _parsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``(command name, parser)`` for the parser and every subcommand below it."""
    yield ("", parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for inner_name, inner in _parsers(sub):
                    yield (inner_name or name, inner)


def _layered_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    exclusive = {id(a) for g in parser._mutually_exclusive_groups for a in g._group_actions}
    return [a for a in parser._actions if _layerable(a, exclusive)]


def parse_layered(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with options not on the command line taken from the environment,
    then from the ``--config`` TOML file, then the parser's defaults."""
    env = os.environ if env is None else env
    trees = list(_parsers(parser))
    for _name, p in trees[1:] or trees:  # every command takes --config (the root too if it is one)
        add_config_option(p)
    saved: list[tuple[argparse.Action, Any, bool]] = []
    for _name, p in trees:
        for action in _layered_actions(p):
            saved.append((action, action.default, action.required))
            # Repeatable options append to their default: None is their "not given" marker.
            action.default = None if _is_list(action) else _UNSET
            action.required = False
    try:
        args = parser.parse_args(argv)
    finally:
        for action, default, required in saved:
            action.default, action.required = default, required
    path = _path(parser, args)
    name = path[-1][0]
    chosen = path[-1][1]
    config_path = getattr(args, "config", None) or env.get(ENV_PREFIX + "CONFIG") or None
    file_values = _read_toml(config_path, name, trees, chosen) if config_path else {}
    missing: list[str] = []
    for _name, owner in path:
        for action in _layered_actions(owner):
            given = getattr(args, action.dest, None)
            if given is not (None if _is_list(action) else _UNSET):
                continue
            value: Any = _UNSET
            raw = env.get(env_name(action))
            if raw is not None:
                value = _from_text(owner, action, raw, f"environment variable {env_name(action)}")
            else:
                for key in _keys(action):
                    if key in file_values:
                        value = _from_toml(owner, action, file_values[key], f"{key!r} in {config_path}")
                        break
            if value is _UNSET:
                if action.required:
                    missing.append("/".join(action.option_strings))
                value = _default(owner, action)
            setattr(args, action.dest, value)
    if missing:
        chosen.error(
            "the following arguments are required: "
            + ", ".join(missing)
            + " (on the command line, as KVINDEX_<OPTION> or in --config)"
        )
    # Options of parsers not chosen keep no marker (argparse only sets the chosen path's fields).
    for key, value in vars(args).items():
        if value is _UNSET:
            setattr(args, key, None)
    return args


def _path(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> list[tuple[str, argparse.ArgumentParser]]:
    """The parsers the command line went through: the root, then each chosen subcommand."""
    path = [("", parser)]
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None:
            return path
        picked = getattr(args, sub.dest, None) if sub.dest is not argparse.SUPPRESS else None
        if picked is None:  # a subparsers action without dest: the one whose options were parsed
            picked = next(
                (
                    n
                    for n, p in sub.choices.items()
                    if all(hasattr(args, a.dest) for a in _layered_actions(p))
                ),
                None,
            )
        if picked not in sub.choices:
            return path
        parser = sub.choices[picked]
        path.append((picked, parser))


def _keys(action: argparse.Action) -> list[str]:
    longs = [s[2:] for s in action.option_strings if s.startswith("--")]
    return longs + [k.replace("-", "_") for k in longs]


def _read_toml(
    path: str, command: str, trees: list[tuple[str, argparse.ArgumentParser]], chosen: argparse.ArgumentParser
) -> dict[str, Any]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        chosen.error(f"cannot read --config {path}: {exc.strerror or exc}")
    except tomllib.TOMLDecodeError as exc:
        chosen.error(f"--config {path} is not valid TOML: {exc}")
    commands = {name for name, _ in trees if name}
    known = {k for _, p in trees for a in _layered_actions(p) for k in _keys(a)}
    values: dict[str, Any] = {}
    table: dict[str, Any] = {}
    for key, value in data.items():
        if key in commands and isinstance(value, dict):
            if key == command:
                table = value
            continue
        if key not in known:
            chosen.error(f"--config {path}: unknown option {key!r}")
        values[key] = value
    for key in table:
        if key not in known:
            chosen.error(f"--config {path}: unknown option {key!r} in [{command}]")
    values.update(table)
    return values


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, text: str, where: str) -> Any:
    try:
        value = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        parser.error(f"{where}: invalid value {text!r}: {exc}")
    if action.choices is not None and value not in action.choices:
        parser.error(f"{where}: {value!r} is not one of {list(action.choices)}")
    return value


def _is_flag(action: argparse.Action) -> bool:
    return isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)


def _is_list(action: argparse.Action) -> bool:
    return isinstance(action, argparse._AppendAction | argparse._ExtendAction) or action.nargs in ("*", "+")


def _from_text(parser: argparse.ArgumentParser, action: argparse.Action, raw: str, where: str) -> Any:
    if _is_flag(action):
        word = raw.strip().lower()
        if word not in _TRUE | _FALSE:
            parser.error(f"{where}: expected true or false, got {raw!r}")
        on = word in _TRUE
        return on if isinstance(action, argparse._StoreTrueAction) else not on
    if _is_list(action):
        return [_convert(parser, action, part.strip(), where) for part in raw.split(",") if part.strip()]
    return _convert(parser, action, raw, where)


def _from_toml(parser: argparse.ArgumentParser, action: argparse.Action, value: Any, where: str) -> Any:
    if _is_flag(action):
        if not isinstance(value, bool):
            parser.error(f"{where}: expected true or false")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if _is_list(action):
        items = value if isinstance(value, list) else [v for v in str(value).split(",") if v.strip()]
        return [_convert(parser, action, str(v), where) for v in items]
    if isinstance(value, dict | list):
        parser.error(f"{where}: expected a single value")
    return _convert(parser, action, str(value) if not isinstance(value, bool) else str(value).lower(), where)


def _default(parser: argparse.ArgumentParser, action: argparse.Action) -> Any:
    default = action.default
    if isinstance(default, str) and callable(action.type):
        # argparse converts string defaults through the type; so do we.
        return _convert(parser, action, default, f"default of {_canonical(action)}")
    return default
