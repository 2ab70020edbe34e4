"""The event-log format: torn tails, corruption, rotation and zstd, on logs of real worker payloads."""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from kvindex.capture import records as R
from kvindex.capture.cli import parse_until
from kvindex.capture.format import LogCorrupt, LogReader, LogWriter, segments
from kvindex.capture.recorder import Recorder, log_meta
from kvindex.capture.replay import Driver, Replayer, replay
from kvindex.cli import main
from workers_shim.publisher import WorkerLog


def _log(path: Path, *, frame_bytes: int = 512, **writer: Any) -> list[list[Any]]:
    """A capture log of two workers (the publisher's own batches and heartbeats, one batch lost),
    in small frames; returns its records as read back."""
    meta = log_meta(R.SOURCE_CAPTURE, "kvindex", created_mono=0.0)
    rec = Recorder(LogWriter(path, meta, frame_bytes=frame_bytes, **writer), clock=lambda: 0.0)
    workers = [WorkerLog(worker=f"w{i}", model="m", block_size=4, epoch=100 + i) for i in range(2)]
    for step in range(40):
        for i, w in enumerate(workers):
            w.stored([1000 * i + step * 3 + j for j in range(3)], tier="gpu" if step % 3 else "cpu")
            if step % 5 == 4:
                w.removed([1000 * i + (step - 4) * 3])
            for subject, payload in w.heartbeat_messages():
                if not (i == 1 and step == 20 and ".events." in subject):  # lost on the way
                    rec.message(subject, payload)
    rec.close()
    return [record for _, _, record in LogReader(path)]


def _replayed(meta: dict[str, Any], records: list[list[Any]]) -> str:
    r = Replayer(meta)
    for record in records:
        r.apply(record)
    return r.digest()


def _frames(path: Path) -> list[int]:
    return sorted({offset for _, offset, _ in LogReader(path)})


def test_a_torn_last_frame_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "a.kvlog"
    records = _log(path)
    frames = _frames(path)
    assert len(frames) > 5
    last = frames[-1]
    meta = LogReader(path).meta
    before = [rec for _, off, rec in LogReader(path) if off < last]
    expected = _replayed(meta, before)
    size = path.stat().st_size
    for cut in (last + 3, last + 8, last + 20, size - 1):  # in the frame header, in its body
        torn = tmp_path / f"torn{cut}.kvlog"
        torn.write_bytes(path.read_bytes()[:cut])
        result = replay(str(torn))
        assert result.error is None
        assert (
            "byte offset" in result.reader.stats.truncated_tail
            and str(last) in result.reader.stats.truncated_tail
        )
        assert result.replayer.records == len(before) < len(records)
        assert result.replayer.digest() == expected
    # Space the writer never filled (a crash with preallocated blocks) reads as a torn tail too.
    zeros = tmp_path / "zeros.kvlog"
    zeros.write_bytes(path.read_bytes() + bytes(4096))
    result = replay(str(zeros))
    assert result.error is None and result.reader.stats.truncated_tail
    assert result.replayer.digest() == _replayed(meta, records)


def test_corruption_in_the_middle_stops_with_the_offset(tmp_path: Path, capsys) -> None:
    path = tmp_path / "a.kvlog"
    _log(path)
    frames = _frames(path)
    bad = frames[len(frames) // 2]
    data = bytearray(path.read_bytes())
    data[bad + 12] ^= 0xFF  # a byte of the frame's body: its checksum fails
    corrupt = tmp_path / "corrupt.kvlog"
    corrupt.write_bytes(bytes(data))
    meta = LogReader(path).meta
    before = [rec for _, off, rec in LogReader(path) if off < bad]
    result = replay(str(corrupt))
    assert isinstance(result.error, LogCorrupt) and result.error.offset == bad
    assert "checksum" in str(result.error)
    assert result.replayer.records == len(before) > 0
    assert result.replayer.digest() == _replayed(meta, before)
    # A nonsense length is corruption too (not a torn tail: more frames follow it).
    data = bytearray(path.read_bytes())
    data[bad : bad + 4] = (1 << 31).to_bytes(4, "little")
    corrupt.write_bytes(bytes(data))
    result = replay(str(corrupt))
    assert isinstance(result.error, LogCorrupt) and result.error.offset == bad
    # The command says where, replays what came before, and fails.
    code = main(["replay", str(corrupt), "--plain", "--timeline", "none"])
    out = capsys.readouterr().out
    assert code == 1
    assert f"byte offset {bad}: bad frame length" in out and "everything before it was replayed" in out
    assert f"state digest: {_replayed(meta, before)}" in out
    # Not a log at all.
    junk = tmp_path / "junk.kvlog"
    junk.write_bytes(b"hello world, this is not a log")
    with pytest.raises(LogCorrupt, match="byte offset 0: not a kvindex event log"):
        LogReader(junk)


def test_rotation_and_zstd_read_as_one_log(tmp_path: Path) -> None:
    plain = tmp_path / "plain.kvlog"
    records = _log(plain)
    meta = LogReader(plain).meta
    expected = _replayed(meta, records)
    assert replay(str(plain)).replayer.digest() == expected

    rotated = tmp_path / "rotated.kvlog"
    writer = LogWriter(rotated, meta, max_bytes=3000, frame_bytes=512)
    for record in records:
        writer.add(record)
    writer.close()
    parts = segments(rotated)
    assert len(parts) >= 3 and all(p.stat().st_size <= 3000 for p in parts)
    assert [rec for _, _, rec in LogReader(rotated)] == records
    assert replay(str(rotated)).replayer.digest() == expected
    # A new log at the same path (a restarted service) keeps the older one aside, whole.
    _log(rotated)
    assert segments(rotated) == [rotated]
    (kept,) = [p for p in tmp_path.glob("rotated-*.kvlog")]
    assert len(segments(kept)) == len(parts)
    assert replay(str(kept)).replayer.digest() == expected

    packed = tmp_path / "packed.kvlog"
    _log(packed, zstd=True, frame_bytes=64 * 1024)
    assert LogReader(packed).zstd and packed.stat().st_size < plain.stat().st_size / 3
    assert replay(str(packed)).replayer.digest() == expected

    # Segments out of order (another session's file in between) are refused with the offset.
    other = tmp_path / "other.kvlog"
    _log(other, max_bytes=3000)
    shutil.copy(segments(other)[1], parts[0].with_name(parts[0].name + ".1"))
    mixed = Driver(str(rotated)).run()
    assert isinstance(mixed.error, LogCorrupt) and "does not follow" in str(mixed.error)


def test_until_accepts_offsets_clock_times_and_timestamps() -> None:
    start = 1_764_470_000.25
    assert parse_until("+90", start) == start + 90
    assert parse_until("1m30s", start) == start + 90
    assert parse_until("250ms", start) == start + 0.25
    assert parse_until("1764470100", start) == 1764470100
    at = parse_until("2025-11-30T03:00:00+00:00", start)
    assert at == 1764471600
    from datetime import datetime

    hhmmss = datetime.fromtimestamp(start + 3600).strftime("%H:%M:%S")
    assert abs(parse_until(hhmmss, start) - (start + 3600)) < 1


def test_a_record_that_raises_is_reported_and_the_replay_goes_on(tmp_path: Path, capsys) -> None:
    path = tmp_path / "a.kvlog"
    records = _log(path)
    meta = LogReader(path).meta
    # A snapshot answer whose keys are not bytes (a writer bug): applying it raises.
    bad = [R.SNAPSHOT, 0.0, records[50][2], "w0", 0, 100, 1, {0: 12345}]
    spliced = tmp_path / "spliced.kvlog"
    writer = LogWriter(spliced, meta, frame_bytes=1)  # one record a frame: offsets name records
    for record in [*records[:50], bad, *records[50:]]:
        writer.add(record)
    writer.close()
    bad_offset = sorted({off for _, off, _ in LogReader(spliced)})[50]
    result = replay(str(spliced))
    assert [e[0] for e in result.replayer.exceptions] == [f"0:{bad_offset}"]
    assert result.replayer.digest() == _replayed(meta, records)  # everything else applied
    assert main(["replay", str(spliced), "--plain", "--timeline", "none"]) == 1
    out = capsys.readouterr().out
    assert f"1 record(s) raised in the consumer; the first, at 0:{bad_offset}" in out and "TypeError" in out


def _timed_log(path: Path, first: float, step: float = 0.5, **writer: Any) -> list[list[Any]]:
    """The records of ``_log``, rewritten with wall times ``first``, ``first + step`` ..."""
    records = _log(path.with_name("source.kvlog"))
    meta = {**LogReader(path.with_name("source.kvlog")).meta, "created_wall": first - 0.1}
    timed = [[r[0], r[1], first + i * step, *r[3:]] for i, r in enumerate(records)]
    out = LogWriter(path, meta, frame_bytes=writer.pop("frame_bytes", 512), **writer)
    for record in timed:
        out.add(record)
    out.close()
    return timed


def test_time_range_reads_the_first_and_last_frames(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = datetime(2025, 11, 30, 4, 47, 0).timestamp()
    plain = tmp_path / "plain.kvlog"
    records = _timed_log(plain, first)
    last = records[-1][2]
    assert LogReader(plain).time_range() == (first, last)
    rotated = tmp_path / "rotated.kvlog"
    _timed_log(rotated, first, max_bytes=3000)
    assert len(segments(rotated)) >= 3 and LogReader(rotated).time_range() == (first, last)
    packed = tmp_path / "packed.kvlog"
    _timed_log(packed, first, zstd=True)
    assert LogReader(packed).time_range() == (first, last)
    # A torn last frame is passed over: the range ends where what a replay reads ends.
    frames = _frames(plain)
    torn = tmp_path / "torn.kvlog"
    torn.write_bytes(plain.read_bytes()[: frames[-1] + 20])
    readable = [rec for _, _, rec in LogReader(torn)]
    assert LogReader(torn).time_range() == (first, readable[-1][2]) and readable[-1][2] < last
    empty = tmp_path / "empty.kvlog"
    LogWriter(empty, LogReader(plain).meta).close()
    assert list(LogReader(empty)) == [] and LogReader(empty).time_range() is None
    assert main(["replay", str(empty), "--until", "+1"]) == 2
    assert capsys.readouterr().err == "error: --until +1: the log holds no records\n"


@pytest.mark.parametrize(
    ("until", "where"),
    [
        ("14:02:07", "after the last"),  # the README's form, on a log recorded at 04:47
        ("04:40", "before the first"),
        ("+1h", "after the last"),
        ("+0", "before the first"),  # the log's creation, 0.1 s before its first record
        ("2025-11-29T04:47:01", "before the first"),  # the right time of day, on the day before
    ],
)
def test_an_until_that_matches_no_record_is_an_error_naming_the_logs_range(
    until: str, where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = datetime(2025, 11, 30, 4, 47, 0).timestamp()
    path = tmp_path / "a.kvlog"
    records = _timed_log(path, first)
    last = datetime.fromtimestamp(records[-1][2]).strftime("%H:%M:%S.%f")[:-3]
    capsys.readouterr()
    assert main(["replay", str(path), "--plain", "--until", until]) == 2
    out = capsys.readouterr()
    assert out.out == ""  # refused before anything is replayed
    assert out.err.startswith(f"error: --until {until} is 2025-11-") and f", {where} record: " in out.err
    assert out.err.endswith(f"the log runs from 2025-11-30 04:47:00.000 to 2025-11-30 {last}\n")


def test_an_until_within_the_log_replays_up_to_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = datetime(2025, 11, 30, 4, 47, 0).timestamp()
    path = tmp_path / "a.kvlog"
    records = _timed_log(path, first)
    for until, replayed in (("04:47:00", 1), ("+10.1", 21), (str(records[-1][2]), len(records))):
        assert main(["replay", str(path), "--plain", "--timeline", "none", "--until", until]) == 0
        assert f"\n{replayed} records replayed" in capsys.readouterr().out


def test_a_query_file_may_be_a_bare_token_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The ``--tokens @FILE`` shape: ranked for the log's only model; with several, which one is asked."""
    path = tmp_path / "a.kvlog"
    _log(path)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(list(range(12))))
    assert main(["replay", str(path), "--plain", "--timeline", "none", "--query", str(bare)]) == 0
    assert f"query {bare} as of " in capsys.readouterr().out
    two = tmp_path / "two.kvlog"
    meta = log_meta(R.SOURCE_CAPTURE, "kvindex", created_mono=0.0)
    rec = Recorder(LogWriter(two, meta), clock=lambda: 0.0)
    for model in ("a", "b"):
        w = WorkerLog(worker=f"w-{model}", model=model, block_size=4, epoch=1)
        w.stored([1, 2, 3])
        for subject, payload in w.heartbeat_messages():
            rec.message(subject, payload)
    rec.close()
    assert main(["replay", str(two), "--plain", "--timeline", "none", "--query", str(bare)]) == 1
    out = capsys.readouterr().out
    assert "error: no model given and the log has 2 (models: 'a', 'b')" in out
    bad = tmp_path / "bad.json"
    bad.write_text('[{"model": "a", "token_ids": [1, -2]}]')
    assert main(["replay", str(two), "--query", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --query {bad}: token_ids: -2 is out of range")
