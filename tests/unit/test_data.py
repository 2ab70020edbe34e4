"""The reference data ships with the package (kvtools/data): found without any folder beside the
repository, read streaming from the gzip file, and packaged in wheels and sdists."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import pytest

import kvtools.data as data
from workers_shim.sim.trace import mooncake_requests, mooncake_rows

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_trace_is_package_data_and_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(data.OVERRIDE_ENV, raising=False)
    trace = data.mooncake_trace()
    assert trace.is_file() and trace.suffix == ".gz"
    assert trace.resolve().is_relative_to((ROOT / "kvtools" / "data").resolve())
    rows = 0
    for row in mooncake_rows(trace):
        rows += 1
        assert len(row["hash_ids"]) == -(-row["input_length"] // 512)
    assert rows == 12031  # the whole trace (kvtools/data/README.md)
    first = mooncake_requests(trace, model="m", limit=2)
    assert [r.prompt_tokens for r in first] == [r["input_length"] for r in mooncake_rows(trace, limit=2)]


def test_shipped_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(data.OVERRIDE_ENV, raising=False)
    names = sorted(p.name for p in data.vllm_captures().glob("*.frames.bin"))
    assert names == [
        "r1_sha256_int.frames.bin",
        "r2_sha256cbor_bytes.frames.bin",
        "r4_serve_sha256_int.frames.bin",
        "r5_hybrid_gemma3_evict.frames.bin",
        "r5_hybrid_gemma3_main.frames.bin",
        "r5_hybrid_gptoss_short.frames.bin",
        "r5_hybrid_llama4_evict.frames.bin",
        "r5_hybrid_mamba2_short.frames.bin",
        "r5_hybrid_nemotronh_short.frames.bin",
        "r5_hybrid_qwen3next_main.frames.bin",
        "r5_hybrid_qwen3next_pmu32.frames.bin",
    ]


def test_override_is_used_or_named_in_the_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(data.OVERRIDE_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=data.OVERRIDE_ENV):
        data.mooncake_trace()
    with pytest.raises(FileNotFoundError, match=data.OVERRIDE_ENV):
        data.vllm_captures()
    (tmp_path / "data" / "mooncake").mkdir(parents=True)
    plain = tmp_path / "data" / "mooncake" / "conversation_trace.jsonl"
    plain.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [7]}\n')
    assert data.mooncake_trace() == plain
    assert [r["hash_ids"] for r in mooncake_rows(plain)] == [[7]]
    (tmp_path / "data" / "vllm-capture").mkdir()
    (tmp_path / "data" / "vllm-capture" / "x.frames.bin").write_bytes(b"")
    assert data.vllm_captures() == tmp_path / "data" / "vllm-capture"


def test_every_data_file_is_package_data() -> None:
    """A file added under kvtools/data but not matched by pyproject's package-data would be missing
    from `pip install .` (and from the sdist)."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = globs["kvtools.data"]
    folder = ROOT / "kvtools" / "data"
    files = [
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    assert files
    missing = [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert not missing, missing
