"""The routing proxy's settings (``kvindex route``'s flags; kvindex/route/proxy.py serves with them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvindex.route.pd import PdConfig
from kvindex.scoring.admission import AdmissionConfig
from kvindex.scoring.objectives import ObjectiveDefaults
from kvindex.security import ClientTLS


@dataclass
class RouteConfig:
    """Settings of one proxy. ``score_timeout``: the index's deadline per request, after which the
    fallback decides; ``connect_timeout``: per engine connection attempt, after which the next
    instance is tried; ``grace``: how long in-flight requests may finish at shutdown."""

    index: str
    host: str = "0.0.0.0"
    port: int = 8080
    top_k: int = 3
    score_timeout: float = 0.05
    connect_timeout: float = 2.0
    release_timeout: float = 1.0
    models_timeout: float = 5.0
    refresh_interval: float = 2.0
    fallback_blocks: int = 4
    grace: float = 30.0
    policy: str = ""  # "" = the index's default (ttft)
    # The pick from the ranking (docs/scoring.md#picking): "" = the index's default (serve --pick);
    # "best" or "softmax" at ``temperature`` (None: the index's default temperature).
    pick: str = ""
    temperature: float | None = None
    # Secured gRPC to the index: TLS / mutual TLS (ClientTLS.from_args of the --tls* flags) and a
    # bearer token (--auth-token-file), as every kvindex client takes them.
    tls: ClientTLS | None = None
    token: str | None = None
    # Admission (kvindex/scoring/admission.py): TTFT objectives and priorities per model (a
    # request's headers override them), the margin, queue threshold and queue bounds.
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    objectives: ObjectiveDefaults = field(default_factory=ObjectiveDefaults)
    # Prefill/decode disaggregation (--pd): each request's prefill and decode on two instances
    # (kvindex/route/pd.py); None serves every request whole on one instance.
    pd: PdConfig | None = None
    # The fallback's instances for a model the index has not reported (--fallback-instance): model ->
    # ["HOST:PORT" or "ID=HOST:PORT", ...], so that a proxy started while the index is down routes.
    fallback_instances: dict[str, list[str]] = field(default_factory=dict)
