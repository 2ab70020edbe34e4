"""The `make run` dashboard's rendering and the costs the demo gives its index, in process (issue 31:
a cut epoch, a nominal load shown as if measured, an unexplained TTFT gap, unexplained counters, no
word of the trace's length). The demo end to end: tests/integration/test_demo.py."""

from __future__ import annotations

import argparse
import re
import time
from collections import deque

import pytest
from rich.console import Console

from kvindex.scoring.costs import DEFAULT_PREFILL, cost_config
from kvindex.v1 import kvindex_pb2 as pb
from kvtools.data import mooncake_trace
from kvtools.demo import (
    LEGEND,
    Tally,
    TraceShape,
    _render,
    epoch_label,
    index_costs,
    parse,
)
from workers_shim.sim import EngineConfig

EPOCH = 1_796_421_624_739_073  # the issue's: shown as "39073", which read as another number


def instance(n: int, epoch: int = EPOCH) -> pb.InstanceInfo:
    return pb.InstanceInfo(
        instance_id=f"sim-{n}/0",
        worker=f"sim-{n}",
        epoch=epoch,
        last_seq=123_456,
        load=pb.Load(running=12, waiting=3, kv_usage=0.52),
        blocks=pb.TierBlocks(gpu=24_750, cpu=50_000),
        gaps=2,
        restarts=1,
        outcomes_exact=12_345,
        outcomes_over=67,
        outcomes_under=8,
        state="exact",
        sync="synced",
        prefill=pb.PrefillFit(source="model"),
    )


def rendered(tally: Tally, now: float, width: int = 110) -> str:
    stats = pb.StatsResponse(
        distinct_blocks=pb.TierBlocks(gpu=100_000, cpu=2_000), snapshots_applied=30, gaps=0
    )
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    console.print(_render([instance(n) for n in range(8)], stats, tally, 1234.0, 60.0, 1.0, now))
    return console.export_text()


def replaying(now: float, speed: float = 1.0) -> Tally:
    """A tally 60 s into a 1,415 s trace: 8 requests/s sent and 7 finished over the last 30 s."""
    tally = Tally(speed=speed, trace_total=12_031, trace_span_s=1414.8, load="8.5 requests/s at x2.5")
    tally.started = now - 60.0
    tally.routed = 480
    tally.sent_at = deque(now - 30.0 + i / 8 for i in range(240))
    tally.finished_at = deque(now - 30.0 + i / 7 for i in range(210))
    tally.pairs = deque((now - 10.0, 0.7, 0.65) for _ in range(50))
    return tally


def test_epoch_is_the_publishers_start_time_in_full() -> None:
    now = EPOCH / 1e6 + 3600
    label = epoch_label(EPOCH, now)
    assert label == time.strftime("%H:%M:%S", time.localtime(EPOCH / 1e6)), label
    assert epoch_label(EPOCH, now + 3 * 86_400) == time.strftime(
        "%m-%d %H:%M:%S", time.localtime(EPOCH / 1e6)
    )
    assert epoch_label(7) == "0x7"  # any u64 is a valid epoch: not every one is a time
    text = rendered(replaying(time.monotonic()), time.monotonic())
    started = epoch_label(EPOCH)
    assert started in text and "39073" not in text


def test_table_fits_110_columns_without_cutting_a_value() -> None:
    text = rendered(replaying(time.monotonic()), time.monotonic(), width=110)
    assert "…" not in text, text
    row = next(line for line in text.splitlines() if "sim-0/0" in line)
    for value in ("24,750", "50,000", "12/3", "52%", "123456", "2/1", "12,345/67/8", "exact"):
        assert value in row, (value, row)


def test_load_is_measured_offered_and_served_next_to_the_traces_average() -> None:
    now = time.monotonic()
    tally = replaying(now)
    offered, served, window = tally.rates(now)
    assert (round(offered, 1), round(served, 1), window) == (8.0, 7.0, 30.0)
    text = " ".join(rendered(tally, now, width=250).split())
    assert "offered 8.0, served 7.0 requests/s (sent and finished, last 30 s)" in text, text
    assert "trace average 8.5 requests/s" in text
    # At --speed 2 the same wall counts are half as many per simulated second.
    assert tally.rates(now)[0] == 2 * replaying(now, speed=2.0).rates(now)[0]


def test_trace_length_progress_and_eta() -> None:
    now = time.monotonic()
    tally = replaying(now)
    assert tally.progress(now) == (
        "480 of 12,031 requests sent (4%); the trace lasts 23 min 35 s, last request in 22 min 35 s"
    )
    fast = replaying(now, speed=2.0)
    assert "23 min 35 s simulated, 11 min 47 s wall (--speed 2)" in fast.progress(now)
    before = Tally(trace_total=12_031, trace_span_s=1414.8)
    assert before.progress(now) == "starting; the trace lasts 23 min 35 s"


def test_ttft_comparison_is_recent_with_its_ratio_and_the_legend_explains_the_rest() -> None:
    now = time.monotonic()
    tally = replaying(now)
    tally.pairs.appendleft((now - 300.0, 3.0, 0.7))  # an old pair: out of the window
    assert tally.ttft(now) == pytest.approx((0.7, 0.65, 50))
    text = " ".join(rendered(tally, now, width=250).split())
    assert re.search(r"0\.700 s vs 0\.650 s \(x1\.08\), last 30 s, 50 requests", text), text
    assert "prefill model calibrated from the engines' samples on 8 of 8 instances" in text
    assert "snapshots 30 (periodic: each instance every ~60 s)" in text
    for name, _text in LEGEND:
        assert name in text
    for said in ("home(+N)", "over-promised", "periodic reconciliation", "rendezvous home"):
        assert said in text, said


def test_index_costs_price_the_simulated_engines() -> None:
    """The demo's index prices its simulated 8B engines with their own costs: its prefill model is
    within 5 % of the engine's TTFT alone on the trace's cold prompts (4 % on average with a quarter
    or half of them cached), where the index's default (a 70B model) is ~4x off."""
    args = parse(["--limit", "2000"])
    shape = TraceShape.read(str(mooncake_trace()), args.limit, args.time_scale)
    assert len(shape.prompts) == 2000 and shape.span > 0
    cfg = EngineConfig.from_profile(args.profile, args.block_size, cpu_blocks=args.cpu_blocks)
    costs = index_costs(args.profile, cfg, shape)
    config = cost_config(costs)  # what `kvindex serve --cost` makes of them
    model = config.default_prefill
    errors = []
    for prompt in shape.prompts:
        for share in (0, 4, 2):
            cached = prompt // share // 16 * 16 if share else 0
            error = abs(model.ms(prompt - cached, prompt) / cfg.alone_ttft_ms(prompt, cached) - 1)
            assert share or error < 0.05, (prompt, error)
            errors.append(error)
    assert sum(errors) / len(errors) < 0.05
    assert DEFAULT_PREFILL.ms(12_000, 12_000) / cfg.alone_ttft_ms(12_000) > 3
    assert config.engine.step_ms == cfg.time.a_ms and config.engine.chunk_tokens == cfg.max_batched_tokens
    # Loading a CPU block costs the index what it costs the engine.
    per_block = config.fetch.per_token_ms[1] * args.block_size
    assert per_block == pytest.approx(cfg.fetch_ms_per_block["cpu"])


def test_costs_default_keeps_the_index_default() -> None:
    assert parse([]).costs == "engines"
    assert parse(["--costs", "default"]).costs == "default"
    assert isinstance(parse([]), argparse.Namespace)
