"""``Tokenizers``: every configured model's tokenizer, one piece cache, and the two entry points the API,
the routing proxy and the ext_proc picker call in-process (``encode_prompt``, ``encode_chat``)."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from kvindex.tokenize.cache import PieceCache, PrefixMemo, Reuse
from kvindex.tokenize.chat import ChatOptions, render_chat
from kvindex.tokenize.errors import TokenizeError
from kvindex.tokenize.loader import ModelTokenizer, load_model_tokenizer
from kvindex.tokenize.segments import (
    boundary_pattern,
    boundary_tokens,
    line_starts_safe,
    special_wrap,
    split,
)

DEFAULT_CACHE_BYTES = 128 << 20
# The most one call adds to the cache (pieces, and the remembered prompt): beyond it a call's new pieces
# are encoded but not kept, so one huge prompt cannot evict what every other conversation cached.
DEFAULT_CALL_BYTES = 16 << 20
MEMO_SHARE = 4  # a quarter of the cache's bytes remembers whole prompts (PrefixMemo), the rest pieces
# A prompt (or rendered chat) longer than this is refused, not encoded: the bound on a call's time
# (encoding costs 0.3-1 us a new character on the 2-core test machine: 8 M characters, some 2 M
# tokens, 3-8 s cold) and memory (the text, its pieces and ids: ~12 bytes a character, tracemalloc).
DEFAULT_MAX_TEXT_CHARS = 8 << 20
# New pieces go to the tokenizer in batches of at most this many characters: the tokenizers library
# builds an Encoding per piece (ids, offsets, token strings, masks: ~100 bytes a token), so batching the
# whole text would hold ~100 bytes per new token at once; per batch it is bounded (~10 MB).
ENCODE_BATCH_CHARS = 1 << 18
_EMPTY = np.zeros(0, dtype=np.uint32)


@dataclass
class _Model:
    index: int  # part of the cache key: models share one cache
    mt: ModelTokenizer
    pattern: re.Pattern[str] | None
    wrap: tuple[np.ndarray, np.ndarray] | None


@dataclass
class TokenizeStats:
    requests: Counter[str] = field(default_factory=Counter)  # "prompt", "chat"
    errors: Counter[str] = field(default_factory=Counter)  # same keys
    seconds: Counter[str] = field(default_factory=Counter)  # time spent, same keys (float values)
    direct_encodes: int = 0  # texts encoded whole because the post-processor is not a fixed wrap


class Tokenizers:
    """Models' tokenizers, loaded from local directories (``kvindex serve --tokenizer MODEL=DIR``).

    ``encode_prompt`` gives the ids of vLLM's ``/v1/completions`` for a text prompt, ``encode_chat``
    those of ``/v1/chat/completions`` for OpenAI messages (docs/tokenize.md says how exactly). Both
    return a read-only uint32 numpy array (``.tolist()`` for a list) and raise ``TokenizeError`` on bad
    input.
    Safe to call from several threads.
    """

    def __init__(
        self,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        call_bytes: int = DEFAULT_CALL_BYTES,
        max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
    ) -> None:
        if cache_bytes < 0 or call_bytes < 0 or max_text_chars < 0:
            raise ValueError("cache_bytes, call_bytes and max_text_chars must not be negative")
        self.max_text_chars = max_text_chars
        memo_bytes = cache_bytes // MEMO_SHARE
        self.cache = PieceCache(cache_bytes - memo_bytes)
        self.memo = PrefixMemo(memo_bytes)
        self.call_bytes = call_bytes
        self.stats = TokenizeStats()
        self._models: dict[str, _Model] = {}
        self._stats_lock = threading.Lock()

    @classmethod
    def from_dirs(
        cls,
        dirs: Mapping[str, str | Path],
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        call_bytes: int = DEFAULT_CALL_BYTES,
        max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
    ) -> Tokenizers:
        tokenizers = cls(cache_bytes, call_bytes, max_text_chars)
        for model, directory in dirs.items():
            tokenizers.load(model, directory)
        return tokenizers

    def load(self, model: str, directory: str | Path) -> ModelTokenizer:
        """Load (or replace) ``model``'s tokenizer from ``directory``; TokenizeError if unusable."""
        mt = load_model_tokenizer(model, directory)
        pattern = boundary_pattern(boundary_tokens(mt.tokenizer), line_starts_safe(mt.tokenizer))
        entry = _Model(len(self._models) + 1, mt, pattern, special_wrap(mt.tokenizer))
        if model in self._models:
            entry.index = max(m.index for m in self._models.values()) + 1  # old pieces age out
        self._models[model] = entry
        self._warm(entry)
        return mt

    @staticmethod
    def _warm(entry: _Model) -> None:
        """Pay the one-time costs now, not on the first request after a start (measured: the first
        chat request took 20-90 ms longer than the next, most of it compiling the chat template):
        compile and run the template once, and encode through the batch path the requests use.
        Nothing enters the piece cache or the stats."""
        mt = entry.mt
        text = "Hello.\nWarm up."
        with contextlib.suppress(TokenizeError):  # no template, or one that wants other messages
            text = render_chat(mt, [{"role": "user", "content": text}], ChatOptions())
        encode_batch = getattr(mt.tokenizer, "encode_batch_fast", mt.tokenizer.encode_batch)
        encode_batch([text, text], add_special_tokens=False)

    def __contains__(self, model: object) -> bool:
        return model in self._models

    def models(self) -> list[str]:
        return sorted(self._models)

    def get(self, model: str) -> ModelTokenizer:
        return self._entry(model).mt

    def boundaries(self, model: str) -> str:
        """Where ``model``'s texts are cut into cached pieces: the pattern, or "" (cached whole)."""
        pattern = self._entry(model).pattern
        return "" if pattern is None else pattern.pattern

    def _entry(self, model: str) -> _Model:
        entry = self._models.get(model)
        if entry is None:
            configured = ", ".join(self.models()) or "none"
            raise TokenizeError(
                f"model {model!r} has no tokenizer configured (configured: {configured}); start kvindex "
                f"serve with --tokenizer {model}=DIR, or send token_ids"
            )
        return entry

    # -- entry points ----------------------------------------------------------------------------

    def encode_prompt(self, model: str, prompt: str, add_special_tokens: bool = True) -> np.ndarray:
        """Token ids of a ``/v1/completions`` text prompt (BOS added by the post-processor by default)."""
        started = time.perf_counter()
        try:
            entry = self._entry(model)
            if not isinstance(prompt, str):
                raise TokenizeError("prompt must be a string")
            ids = self._encode(entry, prompt, add_special_tokens)
        except TokenizeError:
            self._count("prompt", started, error=True)
            raise
        self._count("prompt", started)
        return ids

    def encode_chat(
        self,
        model: str,
        messages: Any,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[Any] | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        documents: list[Any] | None = None,
    ) -> np.ndarray:
        """Token ids of a ``/v1/chat/completions`` request: the template rendered, then encoded without
        adding special tokens (vLLM's default; the template writes BOS)."""
        options = ChatOptions(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
            documents=documents,
            add_special_tokens=add_special_tokens,
        )
        return self.encode_chat_options(model, messages, options)

    def encode_chat_options(self, model: str, messages: Any, options: ChatOptions) -> np.ndarray:
        started = time.perf_counter()
        try:
            entry = self._entry(model)
            text = render_chat(entry.mt, messages, options)
            ids = self._encode(entry, text, options.add_special_tokens)
        except TokenizeError:
            self._count("chat", started, error=True)
            raise
        self._count("chat", started)
        return ids

    def encode_openai(self, body: Mapping[str, Any], chat: bool, model: str | None = None) -> np.ndarray:
        """The prompt ids of an OpenAI request body as vLLM computes them: ``/v1/chat/completions``
        (``chat``) or ``/v1/completions``, with vLLM's defaults for the fields not given. For routers
        that hold the parsed body (the routing proxy, the ext_proc picker). ``model`` overrides
        ``body["model"]`` (a served name mapped to a tokenizer). A completions ``prompt`` of token ids is
        returned as is; a batch of prompts is refused (route each prompt on its own)."""
        name = model if model is not None else body.get("model")
        if not isinstance(name, str) or not name:
            raise TokenizeError("the request has no model")
        if not chat:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return np.array(prompt, dtype=np.uint32)
            if not isinstance(prompt, str):
                raise TokenizeError("prompt must be a string or a list of token ids (one prompt per request)")
            return self.encode_prompt(name, prompt, bool(body.get("add_special_tokens", True)))
        kwargs = body.get("chat_template_kwargs")
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else kwargs
        effort = body.get("reasoning_effort")
        if effort is not None and isinstance(kwargs, dict | None):
            # vLLM passes reasoning_effort to the template and switches thinking on unless told.
            user = kwargs or {}
            kwargs = {**user, "reasoning_effort": effort}
            if "enable_thinking" not in user:
                kwargs["enable_thinking"] = effort != "none"
        options = ChatOptions(
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            chat_template_kwargs=kwargs,
            tools=body.get("tools"),
            documents=body.get("documents"),
            add_special_tokens=bool(body.get("add_special_tokens", False)),
        )
        return self.encode_chat_options(name, body.get("messages"), options)

    def render_chat(self, model: str, messages: Any, options: ChatOptions | None = None) -> str:
        """The prompt text of a chat, as vLLM renders it (for debugging and tests)."""
        return render_chat(self._entry(model).mt, messages, options or ChatOptions())

    # -- encoding --------------------------------------------------------------------------------

    def _encode(self, entry: _Model, text: str, add_special_tokens: bool) -> np.ndarray:
        if len(text) > self.max_text_chars:
            raise TokenizeError(
                f"the prompt text has {len(text)} characters; at most {self.max_text_chars} are allowed "
                "(kvindex serve --tokenize-max-chars)"
            )
        tokenizer = entry.mt.tokenizer
        if add_special_tokens and entry.wrap is None:
            with self._stats_lock:
                self.stats.direct_encodes += 1
            return np.array(tokenizer.encode(text, add_special_tokens=True).ids, dtype=np.uint32)
        body = self._body(entry, text)
        if add_special_tokens:
            assert entry.wrap is not None
            return np.concatenate([entry.wrap[0], body, entry.wrap[1]])
        return body

    def clear_cache(self) -> None:
        """Forget every cached piece and remembered prompt (benchmarks, tests)."""
        self.cache.clear()
        self.memo.clear()

    def _body(self, entry: _Model, text: str) -> np.ndarray:
        """``text``'s ids, without the post-processor's additions: a remembered prompt's ids up to the
        last piece boundary it shares with ``text``, then the rest cut into pieces, each from the piece
        cache or encoded. Adds at most ``call_bytes`` to the cache."""
        reuse: Reuse | None = None
        start = 0
        if entry.pattern is not None and text:
            reuse = self.memo.find(entry.index, text)
            if reuse is not None:
                self.cache.count_reused(len(reuse.ends), len(reuse.ids))
                if reuse.whole:
                    return reuse.ids
                start = reuse.start
        pieces = split(text[start:] if start else text, entry.pattern)
        room = self.call_bytes
        arrays = self.cache.get_many(entry.index, pieces)
        missing = [i for i, ids in enumerate(arrays) if ids is None]
        tokenizer = entry.mt.tokenizer
        # One batch call per ENCODE_BATCH_CHARS: the Rust side encodes the pieces in parallel and skips
        # per-call overhead; the "fast" variant skips character offsets, which only the ids' consumers
        # would need.
        encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        for batch in _batches(missing, pieces):
            encodings = encode_batch([pieces[i] for i in batch], add_special_tokens=False)
            for i, enc in zip(batch, encodings, strict=True):
                ids = np.array(enc.ids, dtype=np.uint32)
                ids.flags.writeable = False  # shared by every prompt containing the piece
                arrays[i] = ids
                room -= self.cache.put((entry.index, pieces[i]), ids, room)
            del encodings
        filled = cast(list[np.ndarray], arrays)  # every None was filled above
        parts: list[np.ndarray] = filled
        if reuse is not None:
            parts = [reuse.ids, *parts]
        if not parts:
            return _EMPTY
        body = parts[0] if len(parts) == 1 else np.concatenate(parts)
        body.flags.writeable = False
        if entry.pattern is not None and pieces:
            lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
            counts = np.fromiter((len(a) for a in filled), dtype=np.int64, count=len(filled))
            ends = np.cumsum(lengths) + start
            tokens = np.cumsum(counts) + (len(reuse.ids) if reuse is not None else 0)
            if reuse is not None:
                ends = np.concatenate([reuse.ends, ends])
                tokens = np.concatenate([reuse.tokens, tokens])
            self.memo.remember(entry.index, text, body, ends, tokens, room, reuse)
        return body

    def _count(self, form: str, started: float, error: bool = False) -> None:
        with self._stats_lock:
            self.stats.requests[form] += 1
            self.stats.seconds[form] += time.perf_counter() - started  # type: ignore[assignment]
            if error:
                self.stats.errors[form] += 1


def _batches(missing: list[int], pieces: list[str]) -> list[list[int]]:
    """``missing`` in runs of at most ENCODE_BATCH_CHARS characters (a longer piece on its own)."""
    out: list[list[int]] = []
    run: list[int] = []
    chars = 0
    for i in missing:
        n = len(pieces[i])
        if run and chars + n > ENCODE_BATCH_CHARS:
            out.append(run)
            run, chars = [], 0
        run.append(i)
        chars += n
    if run:
        out.append(run)
    return out
