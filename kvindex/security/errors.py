"""The one error of security settings."""


class SecurityConfigError(ValueError):
    """A TLS or token setting that cannot work; the message names the flag or file (never the token)."""
