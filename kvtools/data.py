"""Where the shared reference data lives (the Mooncake trace, real vLLM captures).

The data sits next to the repository (``../shared``) on a development machine; a clone elsewhere
(CI's clean clone) finds it through ``KVINDEX_SHARED_DIR`` or the machine's /work/shared.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root


def shared_dir() -> Path:
    candidates = [
        os.environ.get("KVINDEX_SHARED_DIR"),
        str(ROOT.parent / "shared"),
        "/work/shared",
    ]
    for c in candidates:
        if c and (Path(c) / "data").is_dir():
            return Path(c)
    raise FileNotFoundError(
        "shared data not found: set KVINDEX_SHARED_DIR to the folder holding data/mooncake and "
        "data/vllm-capture (tried " + ", ".join(c for c in candidates if c) + ")"
    )


def mooncake_trace() -> Path:
    return shared_dir() / "data" / "mooncake" / "conversation_trace.jsonl"
