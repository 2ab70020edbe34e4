"""``kvindex capture`` and ``kvindex replay``: argument parsing and terminal output.

Output uses rich (tables, a progress bar on a terminal) when it is installed (the ``capture`` extra)
and plain text otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from kvindex.capture.format import LogError, zstd_available
from kvindex.config.args import LOG_FORMAT_HELP, SUBJECT_PREFIX_HELP, PromptFileError, port, read_prompts
from kvindex.config.nats import NatsConfigError, NatsConnectError, NatsSettings, add_nats_arguments
from kvindex.lifecycle import Stop, run
from kvindex.security import add_server_options

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "ms": 0.001}
_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?)(ms|s|m|h)?")


def _size(text: str) -> int:
    """``1048576``, ``64K``, ``100M``, ``2G``."""
    m = re.fullmatch(r"(\d+)([kKmMgG]?)[iI]?[bB]?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: want e.g. 100M")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]


def parse_duration(text: str) -> float | None:
    """``90``, ``90s``, ``1m30s``, ``1h``, ``250ms`` -> seconds; None when it is not one."""
    text = text.strip()
    if not text:
        return None
    pos = 0
    total = 0.0
    while pos < len(text):
        m = _DURATION_RE.match(text, pos)
        if not m:
            return None
        total += float(m.group(1)) * _UNITS[m.group(2) or ""]
        pos = m.end()
    return total


def parse_until(text: str, start_wall: float) -> float:
    """``--until``: Unix time. Accepts ``+90s`` / ``90`` / ``1m30s`` (from the log's start), a Unix
    timestamp, ``HH:MM[:SS[.fff]]`` (local time, on the log's day) or an ISO date-time."""
    text = text.strip()
    rel = parse_duration(text.lstrip("+"))
    if rel is not None:
        if not text.startswith("+") and rel > 1e8:
            return rel  # a Unix timestamp
        return start_wall + rel
    if re.fullmatch(r"\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?", text):
        day = datetime.fromtimestamp(start_wall)
        parts = text.split(":")
        seconds = float(parts[2]) if len(parts) > 2 else 0.0
        at = day.replace(hour=int(parts[0]), minute=int(parts[1]), second=0, microsecond=0).timestamp()
        at += seconds
        if at < start_wall - 43200:  # a log running past midnight
            at += 86400
        return at
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad --until {text!r}: want +SECONDS, 1m30s, HH:MM:SS, an ISO date-time or a Unix time"
        ) from None
    return when.timestamp()


def until_outside(text: str, until: float, span: tuple[float, float] | None) -> str:
    """What is wrong with an ``--until`` that matches no record of a log whose records run over
    ``span`` ("" when it falls within): before the first, nothing would be replayed; after the last
    (a clock time on a log of another day, most often), the stop it asks for never comes."""
    if span is None:
        return f"--until {text}: the log holds no records"
    first, last = span
    if first <= until <= last:
        return ""
    where = "before the first" if until < first else "after the last"
    return (
        f"--until {text} is {fmt_wall(until, date=True)}, {where} record: the log runs from "
        f"{fmt_wall(first, date=True)} to {fmt_wall(last, date=True)}"
    )


def fmt_wall(wall: float, date: bool = False) -> str:
    dt = datetime.fromtimestamp(wall)
    return dt.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] if date else dt.strftime("%H:%M:%S.%f")[:-3]


# -- parsers -------------------------------------------------------------------------------------


def add_capture(sub: Any) -> None:
    p = sub.add_parser(
        "capture",
        help="record every events/heartbeat message under a prefix to an event log",
        description="Record every events/heartbeat message to an append-only event log. This sees the "
        "wire only, not a service's replay/snapshot answers: replaying it runs the consumer without "
        "repairs (holes accepted). Use `kvindex serve --capture` for exact replays.",
    )
    add_nats_arguments(p, default=None, url_help="NATS server URL(s) (required), repeated or comma-separated")
    p.add_argument("--subject-prefix", default="kvindex", help=SUBJECT_PREFIX_HELP)
    p.add_argument("--out", required=True, help="log file (segments FILE.1, FILE.2 ... when rotating)")
    p.add_argument("--zstd", action="store_true", help="compress frames with zstd")
    p.add_argument("--max-bytes", type=_size, default=0, help="rotate segments beyond this size (e.g. 100M)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: on signal)")
    p.add_argument("--log-format", choices=("auto", "json", "console"), default="auto", help=LOG_FORMAT_HELP)


def add_serve_capture(p: Any) -> None:
    g = p.add_argument_group("capture (event log for kvindex replay)")
    g.add_argument("--capture", metavar="FILE", default=None, help="tee everything consumed into FILE")
    g.add_argument("--capture-max-bytes", type=_size, default=0, help="rotate beyond this size (e.g. 256M)")
    g.add_argument("--capture-zstd", action="store_true", help="compress the log with zstd")


def add_replay(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="rebuild the index from an event log with the service's own code",
        description="Rebuild the index from an event log by running the service's consumer and router "
        "on it; print a timeline of notable moments and the final state.",
    )
    p.add_argument("log", help="log file (its segments FILE.1, FILE.2 ... are read after it)")
    p.add_argument(
        "--until", default=None, help="stop at +SECONDS from the start, HH:MM:SS, ISO time or Unix time"
    )
    p.add_argument("--speed", type=float, default=0.0, help="0: as fast as possible; 1: real time; N: N x")
    p.add_argument(
        "--query",
        action="append",
        default=[],
        metavar="PROMPT.json",
        help='rank a prompt (repeatable): {"model": ..., "token_ids": [...]} and ScoreRequest fields, a '
        "list of such objects, or a bare list of token ids (for the log's only model)",
    )
    p.add_argument("--request", default="", metavar="ID", help="stop at a recorded commit; show its ranking")
    p.add_argument(
        "--check-picks",
        action="store_true",
        help="re-rank every recorded Score (with its recorded pick and seed); compare with the live pick",
    )
    p.add_argument(
        "--timeline",
        choices=("notable", "all", "none"),
        default="notable",
        help="moments printed: notable ones without their repeats (default), all, or none",
    )
    p.add_argument("--report", metavar="FILE.json", help="write summary, timeline and queries as JSON")
    p.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="a progress bar on stderr: auto shows it on a terminal",
    )
    p.add_argument("--plain", action="store_true", help="plain text even on a terminal with rich installed")
    p.add_argument("--serve", action="store_true", help="then serve the gRPC API on the replayed state")
    p.add_argument(
        "--grpc-host", default="127.0.0.1", help="address --serve listens on (default: this machine only)"
    )
    p.add_argument("--grpc-port", type=port, default=50051, help="port --serve listens on (0: any free port)")
    add_server_options(p)  # TLS / mutual TLS / token for --serve, as kvindex serve


def serve_capture_config(args: argparse.Namespace) -> Any:
    from kvindex.capture.recorder import CaptureConfig

    if not args.capture:
        return None
    if args.capture_zstd and not zstd_available():
        raise SystemExit("--capture-zstd needs the 'zstandard' package: pip install 'kvindex[capture]'")
    return CaptureConfig(args.capture, max_bytes=args.capture_max_bytes, zstd=args.capture_zstd)


# -- capture -------------------------------------------------------------------------------------


def run_capture(args: argparse.Namespace) -> int:
    from kvindex.capture.recorder import Capture, CaptureConfig
    from kvindex.observability.logs import configure_logging

    configure_logging(args.log_format)
    if args.zstd and not zstd_available():
        print("error: --zstd needs the 'zstandard' package: pip install 'kvindex[capture]'", file=sys.stderr)
        return 2

    try:
        settings = NatsSettings.from_args(args)
    except NatsConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if settings is None:
        print("error: capture needs --nats URL (or KVINDEX_NATS_URL)", file=sys.stderr)
        return 2

    async def main(stop: Stop) -> int:
        cap = Capture(settings, CaptureConfig(args.out, args.max_bytes, args.zstd), args.subject_prefix)
        if args.duration > 0:
            asyncio.get_running_loop().call_later(args.duration, stop.request, "duration")
        try:
            await stop.run_or_stop(cap.start())  # a stop while NATS is unreachable cancels the start
            await stop.wait()
        except (NatsConfigError, NatsConnectError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        finally:
            await cap.stop()  # bounded NATS close, then the log is closed cleanly (a CLOSE record)
        w = cap.recorder.writer
        print(
            f"captured {cap.recorder.messages} messages ({w.records} records, {w.bytes_written} bytes, "
            f"{w.segment + 1} segment(s)) to {args.out}",
            file=sys.stderr,
        )
        return 0

    return run(main, grace=5.0, name="kvindex-capture")


# -- replay --------------------------------------------------------------------------------------


class Output:
    """Timeline lines, tables and messages, through rich when available."""

    def __init__(self, plain: bool = False) -> None:
        self.rich: Any = None
        if not plain and sys.stdout.isatty():  # piped or redirected: plain text, nothing cut
            try:
                from rich.console import Console

                self.rich = Console(highlight=False, soft_wrap=True)
            except ImportError:
                self.rich = None

    def line(self, text: str, style: str = "") -> None:
        if self.rich is not None:
            self.rich.print(text, style=style or None, markup=False)
        else:
            print(text)

    def table(self, title: str, columns: list[str], rows: list[list[Any]]) -> None:
        if self.rich is not None:
            from rich.table import Table

            t = Table(title=title, title_justify="left")
            for col in columns:
                t.add_column(col, justify="right" if col[:1].isdigit() or col in _NUMERIC else "left")
            for row in rows:
                t.add_row(*(str(x) for x in row))
            self.rich.print(t)
            return
        print(title)
        cells = [columns, *[[str(x) for x in row] for row in rows]]
        widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
        for r in cells:
            print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


_NUMERIC = {"epoch", "seq", "gpu", "cpu", "disk", "shared", "gaps", "restarts", "held", "age s", "#"}
_NUMERIC |= {"cost", "ttft ms", "blocks", "hit tok", "wait ms", "prefill ms", "fetch ms", "run/wait"}


def _progress(mode: str, total: int, out: Output) -> Any:
    """A progress bar: on the output's console when that is a terminal (timeline lines then print
    above the bar), else on stderr without touching stdout (which may be a file)."""
    if mode == "off" or (mode == "auto" and not sys.stderr.isatty()):
        return None
    try:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:
        return None
    progress = Progress(
        TextColumn("replaying"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[at]}"),
        console=out.rich if out.rich is not None else Console(stderr=True),
        transient=True,
        redirect_stdout=False,
        redirect_stderr=False,
    )
    progress.add_task("replay", total=total, at="")
    return progress


def _load_queries(paths: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """The prompts of every ``--query`` file (kvindex.config.args.read_prompts: an object, a list of
    them, or a bare list of token ids as ``--tokens @FILE`` takes); PromptFileError naming the file."""
    out = []
    for path in paths:
        items = read_prompts(path)
        for i, item in enumerate(items):
            out.append((path if len(items) == 1 else f"{path}[{i}]", item))
    return out


def _run_query(r: Any, name: str, spec: dict[str, Any]) -> Any:
    """A query's ranking; a prompt without a model (a bare token list) is for the log's only model."""
    from kvindex.capture.replay import QueryResult

    if "model" not in spec:
        models = sorted({s.model for s in r.registry.all()})
        if len(models) != 1:
            known = ", ".join(repr(m) for m in models) or "none"
            return QueryResult(
                name,
                spec,
                None,
                f"no model given and the log has {len(models)} (models: {known}); "
                'write the prompt as {"model": ..., "token_ids": [...]}',
            )
        spec = {"model": models[0], **spec}
    return r.query(spec, name)


def run_replay(args: argparse.Namespace) -> int:
    from kvindex.capture.replay import Driver, Moment

    out = Output(plain=args.plain)
    try:
        queries = _load_queries(args.query)
    except PromptFileError as exc:
        print(f"error: --query {exc}", file=sys.stderr)
        return 2
    show = args.timeline

    def on_moment(m: Moment) -> None:
        if show == "none" or (show == "notable" and (not m.notable or m.repeat)):
            return
        out.line(f"{fmt_wall(m.wall)}  +{m.since_start:9.3f}s  {m.instance:<20} {m.what:<10} {m.text}")

    try:
        driver = Driver(args.log, request=args.request, on_moment=on_moment)
    except (OSError, LogError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    r = driver.replayer
    r.check_picks = args.check_picks
    meta = driver.reader.meta
    if args.until is not None:
        try:
            driver.until = parse_until(args.until, r.start_wall)
            span = driver.reader.time_range()
        except argparse.ArgumentTypeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except LogError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        problem = until_outside(args.until, driver.until, span)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    stats = driver.reader.stats
    out.line(
        f"log {args.log}: {len(stats.segments)} segment(s), {stats.bytes_total} bytes, "
        f"written by `kvindex {meta.get('source')}` on {meta.get('host')} from "
        f"{fmt_wall(r.start_wall, date=True)}, codec {meta.get('codec', 'none')}",
        "bold",
    )
    if not r.exact:
        out.line(
            "note: captured from the wire (no repair answers): replayed without repairs, holes are "
            "counted and accepted; liveness is simulated from heartbeat times",
            "yellow",
        )
    if show != "none":
        out.line("timeline:", "bold")
    if args.serve:
        return run(
            lambda stop: _replay_and_serve(driver, args, out, queries, stop), grace=2.0, name="kvindex-replay"
        )
    _drive(driver, args, out)
    return _report(driver, args, out, queries)


def _drive(driver: Any, args: argparse.Namespace, out: Output) -> None:
    progress = _progress(args.progress, driver.reader.stats.bytes_total, out)
    stats = driver.reader.stats
    if progress is None:
        driver.run(pace=args.speed)
        return
    with progress:
        task = progress.tasks[0].id
        previous = None
        n = 0
        while (mono := driver.step()) is not None:
            if args.speed > 0 and previous is not None and mono > previous:
                time.sleep((mono - previous) / args.speed)
            previous = mono
            n += 1
            if n % 512 == 0 or args.speed > 0:
                progress.update(task, completed=stats.bytes_read, at=fmt_wall(driver.replayer.wall))
        progress.update(task, completed=stats.bytes_total)


async def _replay_and_serve(
    driver: Any, args: argparse.Namespace, out: Output, queries: list, stop: Stop
) -> int:
    """Serve the API while replaying (``--speed`` N: watch the state evolve), then keep serving."""
    from kvindex.capture.serve import serve_replayed
    from kvindex.security import ServerSecurity

    security = ServerSecurity.from_args(args)
    server = await serve_replayed(driver.replayer, args.grpc_host, args.grpc_port, security)
    out.line(f"serving the replayed state on {server.address} (gRPC KvIndex; Ctrl-C stops)", "bold")
    try:
        previous = None
        n = 0
        while not stop.requested and (mono := driver.step()) is not None:
            n += 1
            if args.speed > 0 and previous is not None and mono > previous:
                await asyncio.sleep((mono - previous) / args.speed)
            elif n % 256 == 0:
                await asyncio.sleep(0)  # let queries in
            previous = mono
        code = _report(driver, args, out, queries)
        if not stop.requested:
            out.line(f"replay done; still serving on {server.address}", "bold")
            await stop.wait()
        return code
    finally:
        await server.stop(grace=0.5)


def _report(driver: Any, args: argparse.Namespace, out: Output, queries: list) -> int:
    result = driver.result
    r = result.replayer
    stats = driver.reader.stats
    summary = r.summary()
    if args.timeline == "notable" and r.repeats:
        out.line(f"({r.repeats} repeats of the moments above not shown; --timeline all shows them)")
    if result.stopped_at_until:
        out.line(f"stopped at {fmt_wall(r.wall, date=True)} (--until / --request)", "bold")
    _print_state(out, r, summary)
    out.line(f"state digest: {summary['digest']}", "bold")
    code = 0
    if stats.truncated_tail:
        out.line(f"warning: truncated tail: {stats.truncated_tail}", "yellow")
    if not summary["closed"] and not result.error and not result.stopped_at_until:
        out.line("note: the log has no close record (the writer was killed or is still running)", "yellow")
    if r.divergences:
        first = r.divergences[0]
        out.line(f"error: the replay diverged from the live service at record {first.offset}", "red")
        code = 1
    if r.pick_differences:
        first_pick = r.pick_differences[0]
        out.line(
            f"error: request {first_pick.request_id} (record {first_pick.offset}) re-ranked to "
            f"{first_pick.replayed or '?'}, live it went to {first_pick.live}",
            "red",
        )
        code = 1
    if r.exceptions:
        offset, _error, trace = r.exceptions[0]
        out.line(
            f"error: {len(r.exceptions)} record(s) raised in the consumer; the first, at {offset}:", "red"
        )
        out.line(trace.rstrip())
        code = 1
    if result.error is not None:
        out.line(f"error: {result.error} (everything before it was replayed)", "red")
        code = 1
    results = []
    if result.replayer.watched is not None:
        results.append(result.replayer.watched)
    elif args.request:
        out.line(f"error: no recorded commit of request {args.request!r} in the log", "red")
        code = 1
    results.extend(_run_query(r, name, spec) for name, spec in queries)
    for q in results:
        _print_query(out, q, r.wall)
        if q.error:
            code = 1
    if args.report:
        _write_report(args, driver, summary, results)
    return code


def _print_state(out: Output, r: Any, summary: dict[str, Any]) -> None:
    """The replayed state: the instances, blocks per tier, the counters, the checks of the live state
    and of the picks."""
    out.table(
        f"state at {fmt_wall(r.wall, date=True)}: {len(summary['instances'])} instance(s)",
        [
            "instance",
            "model",
            "epoch",
            "seq",
            "gpu",
            "cpu",
            "disk",
            "shared",
            "sync",
            "health",
            "age s",
            "gaps",
            "restarts",
            "held",
        ],
        [
            [
                i["instance"],
                i["model"],
                i["epoch"],
                i["seq"],
                *i["blocks"].values(),
                i["sync"],
                "pool" if i["pool"] else ("STALE" if i["stale"] else "ok"),
                "-" if i["status_age_s"] is None else f"{i['status_age_s']:.1f}",
                i["gaps"],
                i["restarts"],
                i["held"],
            ]
            for i in summary["instances"]
        ],
    )
    b = summary["blocks"]
    d = summary["distinct_blocks"]
    out.line(
        "blocks per tier (entries / distinct): "
        + ", ".join(f"{t} {b[t]}/{d[t]}" for t in b)
        + f"; in-flight requests {summary['ledger']}"
    )
    c = summary["counters"]
    out.line(
        f"batches received {c['batches_received']}, applied {c['batches_applied']}, "
        f"duplicates {c['duplicates']}, "
        f"gaps {c['gaps']} ({c['missing_batches']} batches), restarts {c['restarts']}, "
        f"replays ok {c['replays_ok']} failed {sum(c['replays_failed'].values())}, "
        f"snapshots {c['snapshots_applied']} ({_pairs(c['snapshots_requested']) or '-'}), "
        f"drift {c['drift_detected']}, stale {c['stale_marked']}, forgotten {c['instances_forgotten']}, "
        f"rejects {sum(c['rejects'].values())}"
    )
    out.line(f"{summary['records']} records replayed ({_pairs(summary['records_by_kind'])})")
    checks = summary["checks"]
    if checks["matched"] or checks["diverged"]:
        out.line(
            f"live-state checks: {checks['matched']} matched, {checks['diverged']} diverged",
            "green" if not checks["diverged"] else "red",
        )
    picks = summary["picks"]
    if picks["checked"]:
        out.line(
            f"picks re-derived: {picks['checked']}, same as live {picks['same']}, differ {picks['differ']}",
            "green" if not picks["differ"] else "red",
        )


def _write_report(args: argparse.Namespace, driver: Any, summary: dict[str, Any], results: list[Any]) -> None:
    """``--report``: the replay's summary, what was read, the timeline and the queries, as JSON."""
    result = driver.result
    r = result.replayer
    stats = driver.reader.stats
    report = {
        "log": args.log,
        "meta": {k: v for k, v in driver.reader.meta.items() if isinstance(v, (str, int, float, bool, dict))},
        "summary": summary,
        "read": {
            "segments": stats.segments,
            "bytes": stats.bytes_total,
            "frames": stats.frames,
            "truncated_tail": stats.truncated_tail,
            "error": None
            if result.error is None
            else {
                "offset": result.error.offset,
                "path": result.error.path,
                "message": result.error.message,
            },
        },
        "timeline": [m.as_dict() for m in r.moments],
        "queries": [_query_dict(q) for q in results],
    }
    Path(args.report).write_text(json.dumps(report, indent=2, default=str))


def _pairs(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def _query_dict(q: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    def as_dict(message: Any) -> Any:
        if message is None:
            return None
        return MessageToDict(
            message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )

    explanation = getattr(q, "explanation", None)
    return {
        "name": q.name,
        "request": q.request,
        "error": q.error,
        "response": as_dict(q.response),
        "instances": [as_dict(i) for i in explanation.instances] if explanation is not None else [],
        "verdict": as_dict(explanation.verdict) if explanation is not None else None,
    }


def _print_query(out: Output, q: Any, wall: float) -> None:
    if q.error:
        out.line(f"query {q.name}: error: {q.error}", "red")
        return
    resp = q.response
    live = q.request.get("committed_live")
    title = (
        f"query {q.name} as of {fmt_wall(wall)}: model {resp.model!r}, {resp.total_blocks} blocks of "
        f"{resp.block_size}, policy {resp.policy} (cost in {resp.cost_unit})"
        + (f"; the live service committed it to {live}" if live else "")
    )
    print_explanation(out, q.explanation, title, resp)


def print_explanation(out: Output, explanation: Any, title: str, ranking: Any = None) -> None:
    """A ranking explained (an ``ExplainResponse``; None: ``ranking``, a ScoreResponse, alone): per
    instance its state, cost and estimate term by term, then why the first won. What ``kvindex
    replay`` shows for a recorded decision and ``kvindex explain`` for a live one."""
    resp = explanation.ranking if explanation is not None else ranking
    extra = list(explanation.instances) if explanation is not None else []
    rows = []
    for i, x in enumerate(resp.ranked, 1):
        m = x.matched
        more = extra[i - 1] if i <= len(extra) else None
        state = more.state + ("" if more.credit == 1.0 else f" x{more.credit:g}") if more is not None else ""
        rows.append(
            [
                i,
                x.instance_id,
                state,
                f"{x.cost:.2f}",
                f"{x.est_ttft_ms:.1f}",
                f"{x.matched_blocks} ({m.gpu}/{m.cpu}/{m.disk}/{m.shared})",
                x.matched_tokens,
                f"{x.wait_ms:.1f}",
                f"{x.prefill_ms:.1f}",
                f"{x.fetch_ms:.1f}",
                f"{x.load.running}/{x.load.waiting}",
                x.explain,
            ]
        )
    out.table(
        title,
        [
            "#",
            "instance",
            "state",
            "cost",
            "ttft ms",
            "blocks (g/c/d/s)",
            "hit tok",
            "wait ms",
            "prefill ms",
            "fetch ms",
            "run/wait",
            "explain",
        ],
        rows,
    )
    if not resp.block_size:
        out.line(f"  (model {resp.model!r} is unknown at this point of the log)")
    elif not rows:
        out.line("  (no routable instance of this model)")
    if explanation is None:
        return
    for more in extra:
        if more.state_reason:
            out.line(f"  {more.instance_id} is {more.state}: {more.state_reason}")
    if rows:
        out.line(f"  why: {explanation.verdict.summary}", "bold")
