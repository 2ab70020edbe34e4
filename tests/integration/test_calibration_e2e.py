"""Calibration from an engine's own prefill times over real parts: a vLLM-like /metrics page (a real
HTTP server in vLLM's exposition format, its per-request histograms growing as requests finish) ->
the real ``kvshim vllm`` bridge -> nats-server (JetStream) -> kvindex -> gRPC ListInstances; the
instance's fit persisted in NATS KV and loaded by a restarted index."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from typing import Any

import grpc
import pytest

from kvindex.cli import main
from kvindex.scoring.costs import CostConfig, PrefillModel
from kvindex.scoring.ranker import RankerConfig
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.integration.bridge_fakes import FakeEngine, MetricsPage, running_bridge

MODEL = "llama-test"
TRUE = PrefillModel(15.0, 0.45, 2e-5)  # a small model on one CPU core


class FinishingEngine(MetricsPage):
    """vLLM's per-request histograms on /metrics; one more request has finished at every read."""

    def __init__(self) -> None:
        self.rng = random.Random(7)
        self.n = 0
        self.seconds = self.prompt = self.computed = 0.0
        super().__init__()

    @property
    def text(self) -> str:
        length = self.rng.randint(200, 6000)
        computed = self.rng.randint(1, length)
        self.n += 1
        self.prompt += length
        self.computed += computed
        self.seconds += TRUE.ms(computed, length) * math.exp(self.rng.gauss(0, 0.03)) / 1000
        labels = f'engine="0",model_name="{MODEL}"'
        return "".join(
            f"# TYPE vllm:{name} histogram\n"
            f'vllm:{name}_bucket{{{labels},le="+Inf"}} {self.n}\n'
            f"vllm:{name}_count{{{labels}}} {self.n}\n"
            f"vllm:{name}_sum{{{labels}}} {total}\n"
            for name, total in (
                ("request_prefill_time_seconds", self.seconds),
                ("request_prompt_tokens", self.prompt),
                ("request_prefill_kv_computed_tokens", self.computed),
            )
        )

    @text.setter
    def text(self, value: str) -> None:  # MetricsPage's constructor sets it
        pass


def scraping_bridge(nats_url: str, engine: FakeEngine, page: MetricsPage) -> Any:
    """``kvshim vllm`` for worker w1 scraping ``page`` often, with quick heartbeats."""
    return running_bridge(
        nats_url,
        engine,
        engine="vllm",
        worker_id="w1",
        model=MODEL,
        block_size=4,
        metrics_url=page.url,
        scrape_interval=0.03,
        heartbeat_interval=0.1,
    )


async def instance(address: str) -> Any:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await pb_grpc.KvIndexStub(channel).ListInstances(pb.ListInstancesRequest(model=MODEL))
    return reply.instances[0] if reply.instances else None


async def test_vllm_prefill_times_calibrate_the_instance_and_persist(
    engine: FakeEngine, capsys: pytest.CaptureFixture[str]
) -> None:
    natsd = EmbeddedNats(jetstream=True)
    await natsd.start()
    page = FinishingEngine()
    cfg = ServiceConfig(nats_url=natsd.url, grpc_host="127.0.0.1", grpc_port=0)
    try:
        first = IndexService(cfg)
        await first.start()
        try:
            async with scraping_bridge(natsd.url, engine, page) as bridge:
                # Before enough samples: the default, as for any new instance.
                await wait_until(lambda: first.registry.get(("w1", 0)) is not None, what="the instance")
                info = await instance(first.grpc.address)
                assert info.prefill.source == "default" and info.prefill.samples < 20

                deadline = time.monotonic() + 20
                while info.prefill.source != "model":  # the calibrated model in use, over gRPC
                    assert time.monotonic() < deadline, f"still {info.prefill}"
                    await asyncio.sleep(0.05)
                    info = await instance(first.grpc.address)
                assert bridge.stats.get("prefill", "sample") >= 25
                # The command line shows it too (`kvindex instances`, JSON of ListInstances).
                args = ["instances", "--server", first.grpc.address, "--model", MODEL]
                assert await asyncio.to_thread(main, args) == 0
                out = capsys.readouterr().out  # (the service's log lines go there too)
                (shown,) = json.loads(out[out.index('{\n  "instances"') :])["instances"]
                assert shown["prefill"]["source"] == "model" and int(shown["prefill"]["samples"]) >= 25
            fit = PrefillModel(info.prefill.a_ms, info.prefill.b_ms_per_token, info.prefill.c_ms_per_token2)
            for length, miss in ((1000, 1000), (4000, 500), (6000, 6000)):
                assert fit.ms(miss, length) == pytest.approx(TRUE.ms(miss, length), rel=0.1)
            assert info.prefill.samples >= 25 and info.prefill.has_error and info.prefill.error < 0.1
            # One instance: its own fit is the shared one, no better: the shared one ranks it.
            assert first.calibrator.own_models(MODEL) == {}
            await first.calibration.save()
            status = first.calibrator.status(MODEL, "w1/0")
        finally:
            await first.stop()
        second = IndexService(cfg)  # a restarted index (or a second replica) starts calibrated
        await second.start()
        try:
            assert second.calibrator.status(MODEL, "w1/0") == status
        finally:
            await second.stop()
    finally:
        page.close()
        await natsd.stop()


async def test_calibration_off_keeps_the_default_model(engine: FakeEngine) -> None:
    """`kvindex serve --no-calibration`: the samples arrive and are counted, the default ranks, and
    the bucket is neither read nor written."""
    natsd = EmbeddedNats(jetstream=True)
    await natsd.start()
    page = FinishingEngine()
    cfg = ServiceConfig(
        nats_url=natsd.url,
        grpc_host="127.0.0.1",
        grpc_port=0,
        ranker=RankerConfig(costs=CostConfig(calibrate=False)),
    )
    service = IndexService(cfg)
    await service.start()
    try:
        async with scraping_bridge(natsd.url, engine, page):
            await wait_until(lambda: service.calibrator.ignored >= 30, timeout=20, what="samples arriving")
            info = await instance(service.grpc.address)
        assert info.prefill.source == "default" and info.prefill.samples == 0
        assert service.calibrator.models == {} and service.calibration.kv is None
    finally:
        await service.stop()
        page.close()
        await natsd.stop()
