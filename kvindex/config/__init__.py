"""Configuration shared by every command: option layering (command line, environment, TOML file)
and the NATS connection settings."""

from kvindex.config.layers import add_config_option, parse_layered
from kvindex.config.nats import (
    NatsConfigError,
    NatsConnectError,
    NatsSettings,
    add_nats_arguments,
    connect,
    redact_url,
)

__all__ = [
    "NatsConfigError",
    "NatsConnectError",
    "NatsSettings",
    "add_config_option",
    "add_nats_arguments",
    "connect",
    "parse_layered",
    "redact_url",
]
