"""Run the fuzz targets (tests/fuzz/harness.py) with atheris, each in its own process.

    python tests/fuzz/run.py --list
    python tests/fuzz/run.py batch -max_total_time=60            # one target; libFuzzer flags after the name
    python tests/fuzz/run.py --all --seconds 2                   # every target in turn (make test runs this)
    python tests/fuzz/run.py --all --seconds 300 --corpus .fuzz  # long runs (make fuzz): corpus kept

Each target starts from its seeds (written to a temporary folder at every run) plus, with --corpus,
the inputs earlier runs found. A crash, an undocumented exception or a broken invariant makes
libFuzzer stop and write the input to ``crash-*`` in the artifacts folder; the run then fails.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _fuzz_one(name: str, libfuzzer_args: list[str]) -> None:
    """In this process: instrument the project's modules, then hand over to libFuzzer."""
    import atheris

    sys.path[:0] = [str(ROOT), str(HERE)]
    with atheris.instrument_imports(include=["kvindex", "kvtools", "workers_shim", "harness"]):
        import harness
    target = harness.TARGETS[name]
    # Seeds are rewritten at every start, in the folder run_all made (removed after) or a fixed one.
    base = Path(os.environ.get("KVINDEX_FUZZ_SEEDS") or Path(tempfile.gettempdir()) / "kvindex-fuzz-seeds")
    seeds_dir = base / name
    seeds_dir.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(harness.seeds(name)):
        (seeds_dir / f"seed-{i}").write_bytes(seed)
    # A libFuzzer dictionary of the msgpack names and values the decoders look for.
    entries = ["".join(f"\\x{b:02x}" for b in word) for word in harness.dictionary()]
    dict_file = seeds_dir.parent / f"{seeds_dir.name}.dict"
    dict_file.write_text("".join(f'"{e}"\n' for e in entries))
    dirs = [a for a in libfuzzer_args if not a.startswith("-")]
    flags = [a for a in libfuzzer_args if a.startswith("-")]
    if not any(f.startswith("-dict=") for f in flags):
        flags.append(f"-dict={dict_file}")
    atheris.Setup([sys.argv[0], *flags, *dirs, str(seeds_dir)], target)
    atheris.Fuzz()


def _stats(output: str) -> dict[str, int]:
    """Executions and coverage from libFuzzer's last status line."""
    runs = re.findall(r"#(\d+)\s+(?:DONE|pulse|NEW|REDUCE|INITED)\s+cov: (\d+) ft: (\d+)", output)
    if not runs:
        return {}
    execs, cov, ft = runs[-1]
    return {"execs": int(execs), "cov": int(cov), "ft": int(ft)}


def run_all(names: list[str], seconds: float, corpus: Path | None, artifacts: Path, jobs: int = 1) -> int:
    """Every target in its own process (``jobs`` at a time); 1 when any failed."""
    from concurrent.futures import ThreadPoolExecutor

    artifacts.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvindex-fuzz-seeds-") as seeds, ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(lambda name: _run_one(name, seconds, corpus, artifacts, seeds), names))
    return 0 if all(results) else 1


def _run_one(name: str, seconds: float, corpus: Path | None, artifacts: Path, seeds: str) -> bool:
    args = [f"-max_total_time={max(1, int(seconds))}", f"-artifact_prefix={artifacts}/{name}-"]
    # Value profiling steers mutations towards comparisons (it found the part-number bug in a minute).
    args += ["-print_final_stats=1", "-rss_limit_mb=2048", "-timeout=10", "-use_value_profile=1"]
    if corpus is not None:
        (corpus / name).mkdir(parents=True, exist_ok=True)
        args.append(str(corpus / name))
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), name, *args],
        capture_output=True,
        text=True,
        timeout=seconds + 120,
        env={**os.environ, "PYTHONHASHSEED": "0", "KVINDEX_FUZZ_SEEDS": seeds},
        check=False,
    )
    took = time.monotonic() - started
    out = proc.stdout + proc.stderr
    stats = _stats(out)
    ok = proc.returncode == 0 and "DONE" in out
    print(
        f"{name:14s} {'ok' if ok else 'FAILED':6s} execs={stats.get('execs', 0):>9} "
        f"cov={stats.get('cov', 0):>5} ft={stats.get('ft', 0):>5} {took:6.1f}s",
        flush=True,
    )
    if not ok:
        print(out[-6000:], file=sys.stderr)
    return ok


def main() -> int:
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        _fuzz_one(sys.argv[1], sys.argv[2:])
        return 0  # not reached: libFuzzer exits
    sys.path[:0] = [str(ROOT), str(HERE)]
    import harness

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="list the targets")
    p.add_argument("--all", action="store_true", help="run every target (or those given with --only)")
    p.add_argument("--only", default="", help="comma-separated targets")
    p.add_argument("--seconds", type=float, default=2.0, help="per target")
    p.add_argument("--jobs", type=int, default=1, help="targets run at once")
    p.add_argument("--corpus", type=Path, default=None, help="keep found inputs under CORPUS/<target>")
    p.add_argument("--artifacts", type=Path, default=Path(tempfile.gettempdir()) / "kvindex-fuzz-artifacts")
    args = p.parse_args()
    if args.list:
        print("\n".join(harness.TARGETS))
        return 0
    names = [n for n in args.only.split(",") if n] or list(harness.TARGETS)
    unknown = set(names) - set(harness.TARGETS)
    if unknown:
        p.error(f"unknown targets {sorted(unknown)}; one of {sorted(harness.TARGETS)}")
    return run_all(names, args.seconds, args.corpus, args.artifacts, max(1, args.jobs))


if __name__ == "__main__":
    sys.exit(main())
