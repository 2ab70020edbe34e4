"""The one error of this package: a request (or a tokenizer directory) that cannot be tokenized."""


class TokenizeError(ValueError):
    """Bad input, a missing tokenizer or template, or a template that refused the request; the message
    says which. The gRPC API answers it with INVALID_ARGUMENT."""
