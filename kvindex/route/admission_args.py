"""The admission flags of ``kvindex route`` and of ``kvindex serve``'s picker (kvindex/route/gate.py
holds the requests; the rule is kvindex/scoring/admission.py)."""

from __future__ import annotations

from typing import Any

from kvindex.scoring.admission import AdmissionConfig
from kvindex.scoring.objectives import HEADER_GIE_OBJECTIVE, HEADER_PRIORITY, HEADER_TTFT, ObjectiveDefaults


def add_admission_options(group: Any, named: bool = False) -> None:
    """The admission flags of ``kvindex route`` and of ``kvindex serve``'s picker; ``named``: also
    ``--objective`` (the Inference Extension's objective names)."""
    group.add_argument(
        "--ttft-slo-ms", action="append", default=[], metavar="[MODEL=]MS",
        help="default TTFT objective, for every model or one (repeatable); a request's "
        f"{HEADER_TTFT} header overrides it",
    )  # fmt: skip
    group.add_argument(
        "--priority", action="append", default=[], metavar="[MODEL=]N",
        help=f"default priority (higher first, negative: sheddable; {HEADER_PRIORITY} overrides)",
    )  # fmt: skip
    if named:
        group.add_argument(
            "--objective", action="append", default=[], metavar="NAME=PRIORITY[:TTFT_MS]",
            help=f"a named objective a gateway's {HEADER_GIE_OBJECTIVE} header may refer to (repeatable)",
        )  # fmt: skip
    group.add_argument(
        "--slo-margin", type=float, default=0.0,
        help="admit while the estimated TTFT is within objective x (1 + margin)",
    )  # fmt: skip
    group.add_argument(
        "--queue-threshold-ms", type=float, default=0.0,
        help="hold requests when every instance's estimated queue wait is past this (0: off)",
    )  # fmt: skip
    group.add_argument("--max-queue", type=int, default=256, help="requests held in the router at most")
    group.add_argument(
        "--max-queue-wait",
        type=float,
        default=30.0,
        help="seconds a request without an objective may be held",
    )


def admission_from_args(args: Any) -> tuple[AdmissionConfig, ObjectiveDefaults]:
    """ValueError (naming the flag) for a malformed value."""
    if args.slo_margin < 0 or args.queue_threshold_ms < 0 or args.max_queue < 1 or args.max_queue_wait <= 0:
        raise ValueError(
            "--slo-margin and --queue-threshold-ms must be >= 0, --max-queue >= 1, --max-queue-wait > 0"
        )
    config = AdmissionConfig(
        margin=args.slo_margin,
        queue_threshold_ms=args.queue_threshold_ms,
        max_queue=args.max_queue,
        max_wait_s=args.max_queue_wait,
    )
    defaults = ObjectiveDefaults.from_flags(args.ttft_slo_ms, args.priority, getattr(args, "objective", ()))
    return config, defaults
