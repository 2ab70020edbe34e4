"""The reference data the demo, the tests and the benchmarks use, shipped inside this package.

``mooncake/conversation_trace.jsonl.gz`` is the Mooncake conversation trace (gzip; read it streaming
with ``workers_shim.sim.trace.mooncake_rows``), ``vllm_capture/`` holds raw KV-event messages of a real
vLLM; README.md beside them says what each file is, where it comes from and its licence. Found with
``importlib.resources``, so a clone, an editable install and ``pip install .`` all have it.

``KVINDEX_SHARED_DIR`` optionally points elsewhere: a folder holding ``data/mooncake/`` and
``data/vllm-capture/`` (e.g. the uncompressed trace). When set it must hold the file asked for; it is
never guessed.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

__all__ = ["OVERRIDE_ENV", "data_dir", "mooncake_trace", "vllm_captures"]

OVERRIDE_ENV = "KVINDEX_SHARED_DIR"
TRACE_NAME = "conversation_trace.jsonl"


def data_dir() -> Path:
    """This package's folder. Python installs packages as plain files (never zipped here), so the
    resource root is a real path that subprocesses and ``open`` can use."""
    root = files(__name__)
    if not isinstance(root, Path):
        raise RuntimeError(f"kvtools.data is not a folder on disk ({root!r}); install kvindex unzipped")
    return root


def _override() -> Path | None:
    value = os.environ.get(OVERRIDE_ENV, "").strip()
    return Path(value) / "data" if value else None


def mooncake_trace() -> Path:
    """The Mooncake conversation trace: the shipped ``.jsonl.gz``, or the override's ``.jsonl`` (or
    ``.jsonl.gz``)."""
    override = _override()
    if override is None:
        return data_dir() / "mooncake" / f"{TRACE_NAME}.gz"
    for name in (TRACE_NAME, f"{TRACE_NAME}.gz"):
        if (override / "mooncake" / name).is_file():
            return override / "mooncake" / name
    raise FileNotFoundError(
        f"{OVERRIDE_ENV}={os.environ[OVERRIDE_ENV]}: no data/mooncake/{TRACE_NAME}[.gz] there "
        f"(unset it to use the trace shipped in kvtools/data)"
    )


def vllm_captures() -> Path:
    """The folder of real vLLM KV-event captures (``*.frames.bin`` and their ``.decoded.txt``)."""
    override = _override()
    if override is None:
        return data_dir() / "vllm_capture"
    folder = override / "vllm-capture"
    if not any(folder.glob("*.frames.bin")):
        raise FileNotFoundError(
            f"{OVERRIDE_ENV}={os.environ[OVERRIDE_ENV]}: no data/vllm-capture/*.frames.bin there "
            f"(unset it to use the captures shipped in kvtools/data)"
        )
    return folder
