"""The engine's own account of a request, read from its OpenAI response: ``usage.prompt_tokens``,
``completion_tokens`` and ``prompt_tokens_details.cached_tokens`` (what vLLM reports with
``--enable-prompt-tokens-details``).

A non-streamed answer carries ``usage`` in its JSON body. A stream carries it only when the request
asked for it (``stream_options.include_usage``, or the engine runs with
``--enable-force-include-usage``), in one last chunk before ``data: [DONE]`` whose ``choices`` is
empty. A router that wants the figure for a client that did not ask adds the option to the request
(:func:`add_include_usage`) and takes that chunk out of the stream again (:class:`UsageReader` with
``strip``), so the client gets the events it asked for.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

MAX_ANSWER_BYTES = 4 * 1024 * 1024  # a non-streamed answer larger than this is not parsed


@dataclass(slots=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


def add_include_usage(raw: bytes) -> bytes | None:
    """``raw`` (a JSON object body with ``stream: true``) asking for the usage chunk; None when it
    already asks, or when the body cannot be changed safely (then nothing is changed)."""
    if b'"stream_options"' not in raw:
        # The key appears nowhere: it is absent, and one more key at the start keeps every byte of
        # the client's body as it was (no re-encoding of the prompt).
        start = raw.find(b"{")
        if start < 0:
            return None
        rest = raw[start + 1 :].lstrip()
        sep = b"" if rest.startswith(b"}") else b","
        return raw[: start + 1] + b'"stream_options":{"include_usage":true}' + sep + raw[start + 1 :]
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    options = body.get("stream_options")
    if options is None:
        options = body["stream_options"] = {}
    if not isinstance(options, dict) or options.get("include_usage") is True:
        return None
    options["include_usage"] = True
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _usage_of(obj: Any) -> Usage | None:
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    out = Usage()
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int) and not isinstance(prompt, bool):
        out.prompt_tokens = prompt
    if isinstance(completion, int) and not isinstance(completion, bool):
        out.completion_tokens = completion
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        cached = details.get("cached_tokens")
        if isinstance(cached, int) and not isinstance(cached, bool):
            out.cached_tokens = cached
    return out


class UsageReader:
    """Watches a response body go by and keeps its ``usage``.

    ``stream``: the body is server-sent events; ``strip``: the usage-only chunk is removed from what
    :meth:`feed` returns (the client did not ask for it). Without ``strip`` every byte is returned
    as it came, at once; with it, bytes are held only until their event is complete.
    """

    def __init__(self, stream: bool, strip: bool = False) -> None:
        self.stream = stream
        self.strip = strip and stream
        self.usage: Usage | None = None
        self._buf = bytearray()
        self._too_large = False

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to pass on for ``chunk``."""
        if not self.stream:
            if not self._too_large:
                if len(self._buf) + len(chunk) > MAX_ANSWER_BYTES:
                    self._too_large = True
                    self._buf.clear()
                else:
                    self._buf += chunk
            return chunk
        buf = self._buf
        buf += chunk
        out = bytearray() if self.strip else None
        while True:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            event = bytes(buf[: end + 2])
            del buf[: end + 2]
            keep = self._event(event)
            if out is not None and keep:
                out += event
        if out is None:
            if len(buf) > MAX_ANSWER_BYTES:  # not events after all: stop looking
                buf.clear()
            return chunk
        return bytes(out)

    def finish(self) -> bytes:
        """At the end of the body: what is still held (an unterminated last event), and the usage
        of a non-streamed answer is read."""
        if not self.stream:
            if self._buf and not self._too_large:
                with contextlib.suppress(UnicodeDecodeError, ValueError):
                    self.usage = _usage_of(json.loads(bytes(self._buf)))
            self._buf.clear()
            return b""
        rest = bytes(self._buf)
        self._buf.clear()
        if rest and not self._event(rest):
            return b""
        return rest if self.strip else b""

    def _event(self, event: bytes) -> bool:
        """Read one event; False when it is the usage-only chunk and it is to be stripped."""
        if b'"usage"' not in event:
            return True
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if not payload.startswith(b"{"):
                continue
            try:
                obj = json.loads(payload)
            except (UnicodeDecodeError, ValueError):
                continue
            usage = _usage_of(obj)
            if usage is None:
                continue
            self.usage = usage
            if self.strip and obj.get("choices") == []:
                return False
        return True
