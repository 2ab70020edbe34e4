"""Text and chat prompts -> token ids, exactly as vLLM computes them (docs/tokenize.md)."""

from kvindex.tokenize.chat import ChatOptions
from kvindex.tokenize.errors import TokenizeError
from kvindex.tokenize.registry import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_CALL_BYTES,
    DEFAULT_MAX_TEXT_CHARS,
    Tokenizers,
)

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_CALL_BYTES",
    "DEFAULT_MAX_TEXT_CHARS",
    "ChatOptions",
    "TokenizeError",
    "Tokenizers",
]
