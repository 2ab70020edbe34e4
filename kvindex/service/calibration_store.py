"""Persists and shares prefill-model calibrations in a NATS KV bucket.

One key per model's shared fit (the model name, base64url) and one per instance's own fit (model
and instance id, each base64url, joined by ".": base64url has no ".").

At start every stored calibration is loaded (a restarted index, or a second replica, ranks with a
calibrated model from its first request); afterwards changed calibrations are written every few
seconds. Needs JetStream on the server; without it calibration stays in memory and a warning says
so.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from typing import Any

import structlog
from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError, NoKeysError

from kvindex.lifecycle.bounded import finish
from kvindex.scoring.calibration import Calibrator

BUCKET = "kvindex_calibration"


def _key(model: str) -> str:
    # KV keys allow [-/_=.a-zA-Z0-9]; model names may hold anything.
    return base64.urlsafe_b64encode(model.encode()).decode().rstrip("=") or "_"


def _model(key: str) -> str:
    return base64.urlsafe_b64decode(key + "=" * (-len(key) % 4)).decode()


def _entry_key(model: str, instance: str) -> str:
    return f"{_key(model)}.{_key(instance)}" if instance else _key(model)


def _entry(key: str) -> tuple[str, str]:
    """(model, instance id or "") of a bucket key."""
    model, _, instance = key.partition(".")
    return _model(model), _model(instance) if instance else ""


class CalibrationStore:
    def __init__(
        self,
        calibrator: Calibrator,
        bucket: str = BUCKET,
        interval: float = 5.0,
        log: Any = None,
        replicas: int = 1,  # bucket copies in a NATS cluster
    ) -> None:
        self.calibrator = calibrator
        self.replicas = replicas
        self.bucket = bucket
        self.interval = interval
        self.log = log or structlog.get_logger("kvindex.calibration")
        self.kv: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, nc: Client) -> None:
        if not self.calibrator.learn:
            self.log.info("calibration_off", reason="--no-calibration: the default prefill model ranks")
            return
        js = nc.jetstream()
        try:
            try:
                self.kv = await js.key_value(self.bucket)
            except BucketNotFoundError:
                self.kv = await js.create_key_value(bucket=self.bucket, history=1, replicas=self.replicas)
            loaded = await self.load()
        except Exception as exc:  # no JetStream on this server
            self.kv = None
            self.log.warning("calibration_not_persisted", reason=str(exc) or type(exc).__name__)
            return
        self.log.info("calibration_loaded", bucket=self.bucket, entries=loaded)
        self._task = asyncio.create_task(self._loop(), name="kvindex-calibration")

    async def load(self) -> int:
        try:
            keys = await self.kv.keys()
        except NoKeysError:
            return 0
        for key in keys:
            entry = await self.kv.get(key)
            if entry.value:
                model, instance = _entry(key)
                self.calibrator.restore(model, json.loads(entry.value), instance)
        return len(keys)

    async def save(self) -> int:
        dirty, self.calibrator.dirty = self.calibrator.dirty, set()
        for model, instance in dirty:
            data = self.calibrator.export(model, instance)
            await self.kv.put(_entry_key(model, instance), json.dumps(data).encode())
        return len(dirty)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.save()
            except Exception as exc:
                self.log.warning("calibration_save_failed", error=str(exc))

    async def stop(self) -> None:
        if self._task is not None:
            await finish([self._task], 1.0)
            self._task = None
        if self.kv is not None:
            with contextlib.suppress(Exception):
                await self.save()
