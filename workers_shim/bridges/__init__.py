"""Engine bridges: vLLM, SGLang and TensorRT-LLM native KV events -> the project's events on NATS.

- :mod:`.native`: decode the engines' msgpack payloads (every shape) into one normalized form
- :mod:`.extras`: the engines' per-block extra keys (multimodal, prompt embeddings) -> key suffixes
- :mod:`.translate`: engine hash -> block key map with per-tier refcounts, per (worker, dp_rank)
- :mod:`.stream`: the ZMQ live subscriber and the replay (DEALER) client
- :mod:`.load`: Prometheus /metrics scraping into the heartbeat's load
- :mod:`.engines`: per-engine defaults, medium names, metric names
- :mod:`.stats`: counters by reason, throttled logs, Prometheus exposition
- :mod:`.bridge`: the run loop (sequence numbers, gaps, restarts, recovery, publishers)

See README.md in this folder and docs/bridges.md.
"""

from workers_shim.bridges.bridge import Bridge, BridgeConfig
from workers_shim.bridges.engines import ENGINES
from workers_shim.bridges.stats import BridgeStats

__all__ = ["ENGINES", "Bridge", "BridgeConfig", "BridgeStats"]
