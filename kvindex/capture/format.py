"""The event-log file format: a header, then CRC-checked frames of msgpack records; segments.

    header  = MAGIC (8) | version u16 | flags u16 | meta_len u32 | crc32(meta) u32 | meta (msgpack map)
    frame   = body_len u32 | crc32(body) u32 | body
    body    = record record ...            (concatenated msgpack arrays; zstd-compressed if flags & ZSTD)

All integers are little-endian. A writer appends whole frames with one ``write`` each, so a process
killed at any moment leaves at worst one partial frame at the end of the file: the reader detects it
(its length runs past the end of the file, or it is the last frame and its checksum fails) and
ignores it with a warning. Anything else that does not check out is corruption: the reader stops
with ``LogCorrupt`` naming the byte offset, after having yielded every record before it.

A log may be split into segments by size: ``FILE``, ``FILE.1``, ``FILE.2`` ... each with its own header
(same ``session``, increasing ``segment``) and only whole frames; they read as one stream.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

MAGIC = b"KVIXLOG\n"
VERSION = 1
FLAG_ZSTD = 1
_HEADER = struct.Struct("<8sHHII")
_FRAME = struct.Struct("<II")
MAX_FRAME = 1 << 30  # a larger length is corruption, not data
MAX_META = 1 << 20
DEFAULT_FRAME_BYTES = 64 * 1024

ZSTD_HINT = "zstd logs need the 'zstandard' package: pip install 'kvindex[capture]'"


class LogError(Exception):
    """A log that cannot be read (further): ``path`` and byte ``offset`` say where."""

    def __init__(self, path: str | Path, offset: int, message: str) -> None:
        super().__init__(f"{path}: byte offset {offset}: {message}")
        self.path = str(path)
        self.offset = offset
        self.message = message


class LogCorrupt(LogError):
    """Bad bytes where a header, frame or record should be; what came before was read."""


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - exercised only without the optional extra
        return None
    return zstandard


def zstd_available() -> bool:
    return _zstd() is not None


def segment_path(path: str | Path, n: int) -> Path:
    """Segment ``n`` of a log: the path itself for 0, ``PATH.n`` after it."""
    p = Path(path)
    return p if n == 0 else p.with_name(f"{p.name}.{n}")


def segments(path: str | Path) -> list[Path]:
    """The log's segments in order: ``path``, then ``path.1``, ``path.2`` ... while they exist."""
    out = [Path(path)]
    n = 1
    while (p := segment_path(path, n)).exists():
        out.append(p)
        n += 1
    return out


# -- writing -------------------------------------------------------------------------------------


class LogWriter:
    """Appends records to a log, in frames of about ``frame_bytes``, rotating segments by size.

    ``add`` only buffers; a frame is written when the buffer is full and on ``flush`` (call it
    periodically: what is buffered is what a kill loses) and ``close``. With ``max_bytes`` a new
    segment is started before a frame that would take the current one past it (a segment always holds
    at least one frame, so a single huge record still fits somewhere).
    """

    def __init__(
        self,
        path: str | Path,
        meta: dict[str, Any],
        *,
        zstd: bool = False,
        max_bytes: int = 0,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
        zstd_level: int = 3,
    ) -> None:
        self.path = Path(path)
        self.meta = dict(meta)
        self.max_bytes = max_bytes
        self.frame_bytes = frame_bytes
        self._compressor: Any = None
        if zstd:
            mod = _zstd()
            if mod is None:
                raise RuntimeError(ZSTD_HINT)
            self._compressor = mod.ZstdCompressor(level=zstd_level)
        self._packer = msgpack.Packer(use_bin_type=True)
        self._buf = bytearray()
        self._records_in_buf = 0
        self.segment = -1
        self.segment_size = 0
        self.segment_frames = 0
        self.records = 0
        self.bytes_written = 0
        self.frames = 0
        self._file: Any = None
        self.closed = False
        # Never overwrite an older log (a restarted service would lose the one it wrote before), nor
        # leave its segments where they would read as this log's tail: move them aside.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.kept = keep_aside(self.path)
        self._open_segment(0)

    def _open_segment(self, n: int) -> None:
        if self._file is not None:
            self._file.close()
        self.segment = n
        meta = {**self.meta, "segment": n, "codec": "zstd" if self._compressor is not None else "none"}
        body = msgpack.packb(meta, use_bin_type=True)
        flags = FLAG_ZSTD if self._compressor is not None else 0
        header = _HEADER.pack(MAGIC, VERSION, flags, len(body), zlib.crc32(body)) + body
        path = segment_path(self.path, n)
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - kept open across calls
        _write_all(self._file, header)
        self.segment_size = len(header)
        self.segment_frames = 0
        self.bytes_written += len(header)

    def add(self, record: list[Any]) -> None:
        self._buf += self._packer.pack(record)
        self._records_in_buf += 1
        self.records += 1
        if len(self._buf) >= self.frame_bytes:
            self.flush()

    @property
    def pending(self) -> int:
        return len(self._buf)

    def flush(self) -> None:
        """Write what is buffered as one frame (nothing if empty)."""
        if not self._buf or self._file is None:
            return
        body = bytes(self._buf)
        if self._compressor is not None:
            body = self._compressor.compress(body)
        self._buf.clear()
        self._records_in_buf = 0
        frame = _FRAME.pack(len(body), zlib.crc32(body)) + body
        if self.max_bytes and self.segment_frames and self.segment_size + len(frame) > self.max_bytes:
            self._open_segment(self.segment + 1)
        _write_all(self._file, frame)
        self.segment_size += len(frame)
        self.segment_frames += 1
        self.frames += 1
        self.bytes_written += len(frame)

    def sync(self) -> None:
        """flush, then ask the OS to put the file on disk (survives a machine crash, not just a kill)."""
        self.flush()
        if self._file is not None:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
        finally:
            self.closed = True
            if self._file is not None:
                self._file.close()
                self._file = None


def _write_all(f: Any, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = f.write(view)
        view = view[n:]


def keep_aside(path: str | Path) -> Path | None:
    """Rename an existing log at ``path`` (all its segments) to ``NAME-<its start time>.EXT``;
    returns the new name, None when there was nothing there."""
    p = Path(path)
    if not p.exists():
        return None
    try:
        with open(p, "rb") as f:
            started = float(read_header(p, f)[0].get("created_wall", 0.0))
    except (LogError, OSError, ValueError):
        started = 0.0
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(started or p.stat().st_mtime))
    base = p.with_name(f"{p.stem}-{stamp}{p.suffix}")
    n = 1
    while base.exists():
        base = p.with_name(f"{p.stem}-{stamp}-{n}{p.suffix}")
        n += 1
    for i, seg in enumerate(segments(p)):
        seg.rename(segment_path(base, i))
    return base


# -- reading -------------------------------------------------------------------------------------


@dataclass
class ReadStats:
    """What a read got through, for reports."""

    segments: list[str] = field(default_factory=list)
    frames: int = 0
    records: int = 0
    bytes_total: int = 0  # of all segments
    bytes_read: int = 0  # good frames and headers so far
    truncated_tail: str = ""  # a partial last frame was ignored: where and why
    error: LogError | None = None


def read_header(path: str | Path, f: BinaryIO) -> tuple[dict[str, Any], int, bool]:
    """(meta, offset of the first frame, zstd?) of a segment; LogCorrupt if it has no valid header."""
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        if head and MAGIC.startswith(head[: len(MAGIC)]):
            raise LogCorrupt(path, 0, f"truncated header ({len(head)} bytes): not a complete kvindex log")
        raise LogCorrupt(path, 0, "not a kvindex event log (empty or bad magic)")
    magic, version, flags, meta_len, crc = _HEADER.unpack(head)
    if magic != MAGIC:
        raise LogCorrupt(path, 0, "not a kvindex event log (bad magic)")
    if version != VERSION:
        raise LogCorrupt(path, 8, f"unsupported log version {version} (this kvindex reads {VERSION})")
    body = f.read(meta_len) if meta_len <= MAX_META else b""
    if len(body) != meta_len:
        raise LogCorrupt(path, _HEADER.size, f"truncated or corrupt header ({meta_len} bytes of metadata)")
    if zlib.crc32(body) != crc:
        raise LogCorrupt(path, _HEADER.size, "header checksum mismatch")
    try:
        meta = msgpack.unpackb(body, raw=False)
    except Exception as exc:
        raise LogCorrupt(path, _HEADER.size, f"undecodable header: {exc}") from None
    if not isinstance(meta, dict):
        raise LogCorrupt(path, _HEADER.size, "header metadata is not a map")
    return meta, _HEADER.size + meta_len, bool(flags & FLAG_ZSTD)


class LogReader:
    """Reads a log (all its segments) as one stream of records.

    Iterating yields ``(segment, offset, record)``, ``offset`` being the byte offset of the record's
    frame in its segment. A partial last frame of the last segment is skipped (``stats.truncated_tail``
    says so). Corruption anywhere else raises ``LogCorrupt`` after every record before it was yielded.
    """

    def __init__(self, path: str | Path, *, follow_segments: bool = True) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"{path}: no such log")
        self.paths = segments(self.path) if follow_segments else [self.path]
        self.stats = ReadStats(
            segments=[str(p) for p in self.paths], bytes_total=sum(p.stat().st_size for p in self.paths)
        )
        with open(self.paths[0], "rb") as f:
            self.meta, _, self.zstd = read_header(self.paths[0], f)

    def __iter__(self) -> Iterator[tuple[int, int, list[Any]]]:
        session = self.meta.get("session")
        first = int(self.meta.get("segment", 0))
        for i, path in enumerate(self.paths):
            with open(path, "rb") as f:
                meta, pos, zstd = read_header(path, f)
                if i and (meta.get("session") != session or meta.get("segment") != first + i):
                    raise LogCorrupt(
                        path,
                        0,
                        f"segment {meta.get('segment')} of session {meta.get('session')} does not follow "
                        f"segment {first + i - 1} of session {session}",
                    )
                self.stats.bytes_read += pos
                size = os.fstat(f.fileno()).st_size
                yield from self._frames(path, f, pos, size, zstd, i, last_segment=i == len(self.paths) - 1)

    def time_range(self) -> tuple[float, float] | None:
        """(first, last) wall time of the log's records; None when it holds none. Read from the first
        and the last whole frames only, found by their lengths, so a log of many GiB answers at once;
        a torn or corrupt frame is passed over here (iterating reports it)."""
        first = last = None
        for path in self.paths:
            first = self._edge_wall(path, first=True)
            if first is not None:
                break
        for path in reversed(self.paths):
            last = self._edge_wall(path, first=False)
            if last is not None:
                break
        return None if first is None or last is None else (first, last)

    def _edge_wall(self, path: Path, *, first: bool) -> float | None:
        """The wall time of the first (or last) record of the first (or last) readable frame."""
        with open(path, "rb") as f:
            _meta, pos, zstd = read_header(path, f)
            mod = _zstd() if zstd else None
            if zstd and mod is None:
                raise LogError(path, 0, ZSTD_HINT)
            size = os.fstat(f.fileno()).st_size
            spans = []
            while pos + _FRAME.size <= size:
                f.seek(pos)
                length, crc = _FRAME.unpack(f.read(_FRAME.size))
                end = pos + _FRAME.size + length
                if length == 0 or length > MAX_FRAME or end > size:
                    break
                spans.append((pos, length, crc))
                if first:
                    break  # frames are walked in order: the first whole one is enough
                pos = end
            for start, length, crc in spans if first else reversed(spans):
                f.seek(start + _FRAME.size)
                body = f.read(length)
                if zlib.crc32(body) != crc:
                    continue
                try:
                    if mod is not None:
                        body = mod.ZstdDecompressor().decompress(body, max_output_size=MAX_FRAME)
                    walls = [float(r[2]) for r in _records(path, start, body) if len(r) > 2]
                except Exception:  # undecodable: iterating reports it where it is; look further here
                    continue
                if walls:
                    return walls[0] if first else walls[-1]
        return None

    def _frames(
        self, path: Path, f: BinaryIO, pos: int, size: int, zstd: bool, segment: int, last_segment: bool
    ) -> Iterator[tuple[int, int, list[Any]]]:
        dctx = None
        if zstd:
            mod = _zstd()
            if mod is None:
                raise LogError(path, 0, ZSTD_HINT)
            dctx = mod.ZstdDecompressor()
        while pos < size:
            start = pos
            head = f.read(_FRAME.size)
            if len(head) < _FRAME.size:
                self._torn(path, start, size, last_segment, "a partial frame header")
                return
            length, crc = _FRAME.unpack(head)
            end = pos + _FRAME.size + length
            if length == 0 or length > MAX_FRAME:
                if last_segment and not head.strip(b"\0") and not f.read().strip(b"\0"):
                    self._torn(path, start, size, last_segment, "zero bytes (space never written)")
                    return
                raise LogCorrupt(path, start, f"bad frame length {length}")
            if end > size:
                self._torn(path, start, size, last_segment, f"a frame of {length} bytes cut short")
                return
            body = f.read(length)
            if zlib.crc32(body) != crc:
                if end == size and last_segment:
                    self._torn(path, start, size, last_segment, "a last frame whose checksum fails")
                    return
                raise LogCorrupt(path, start, f"frame checksum mismatch ({length} bytes)")
            if dctx is not None:
                try:
                    body = dctx.decompress(body, max_output_size=MAX_FRAME)
                except Exception as exc:
                    raise LogCorrupt(path, start, f"frame does not decompress: {exc}") from None
            records = _records(path, start, body)
            self.stats.frames += 1
            self.stats.records += len(records)
            self.stats.bytes_read += end - start
            for record in records:
                yield segment, start, record
            pos = end

    def _torn(self, path: Path, start: int, size: int, last_segment: bool, what: str) -> None:
        if not last_segment:
            raise LogCorrupt(path, start, f"segment ends in {what} but later segments follow")
        self.stats.bytes_read += size - start
        self.stats.truncated_tail = (
            f"{path}: byte offset {start}: ignored {size - start} trailing bytes ({what}; "
            "the writer was probably killed mid-write)"
        )


def _records(path: Path, start: int, body: bytes) -> list[list[Any]]:
    """The records of one frame's body, all or none (a frame is checked whole before it is used)."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(body), 1), strict_map_key=False)
    unpacker.feed(body)
    out: list[list[Any]] = []
    try:
        for record in unpacker:
            if not isinstance(record, list) or not record or not isinstance(record[0], int):
                raise ValueError(f"record {len(out)} is not a [kind, ...] array")
            out.append(record)
    except Exception as exc:
        raise LogCorrupt(path, start, f"bad record in frame: {exc}") from None
    if unpacker.tell() != len(body):
        raise LogCorrupt(path, start, f"frame ends inside record {len(out)}")
    return out
