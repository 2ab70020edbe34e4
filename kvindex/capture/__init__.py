"""Capture and replay of event logs: record what the service consumes, rebuild it anywhere.

- ``format``: the log file (header, CRC-checked frames of msgpack records, optional zstd, segments).
- ``records``: the record kinds.
- ``recorder``: ``Recorder`` (fed by the service's NATS source and repairer), ``Capture`` (standalone).
- ``replay``: ``Replayer`` / ``Driver``: the service's Consumer and Ranker driven by a log.
- ``digest``: the state digest both sides compare.
"""

from kvindex.capture.digest import state_digest
from kvindex.capture.format import LogCorrupt, LogError, LogReader, LogWriter
from kvindex.capture.recorder import Capture, CaptureConfig, Recorder

__all__ = [
    "Capture",
    "CaptureConfig",
    "LogCorrupt",
    "LogError",
    "LogReader",
    "LogWriter",
    "Recorder",
    "state_digest",
]
