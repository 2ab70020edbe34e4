"""Block keys for one prompt: the native chain (kvindex/_xxh3.h, one C loop) against one
``xxhash.xxh3_64_intdigest`` call per block (what a Python shim or router would write), same run.

    .venv/bin/python benchmarks/bench_keys.py [--tokens 8192] [--repeat 2000]

Prints the time per prompt for each and the ratio (target: the native chain >= 5x faster), for the
usual 16-token blocks and for block sizes whose blocks take XXH3's mid-size and long paths.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import xxhash

from kvindex import keys
from kvindex.keys import model_seed, tokens_to_le_bytes


def per_block_python(raw: bytes, block_size: int, seed: int) -> list[int]:
    """The baseline: one xxhash package call per block."""
    step = block_size * 4
    mv = memoryview(raw)
    out = []
    key = seed
    for off in range(0, len(raw) - len(raw) % step, step):
        key = xxhash.xxh3_64_intdigest(mv[off : off + step], key)
        out.append(key)
    return out


def time_per_call(fn, args: tuple, repeat: int) -> float:
    """Median of 7 batches, seconds per call."""
    samples = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn(*args)
        samples.append((time.perf_counter() - t0) / repeat)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    if keys._chain_keys is None:
        raise SystemExit("kvindex/_keys_native.pyx is not built: nothing to compare")
    rng = random.Random(7)
    raw = tokens_to_le_bytes([rng.randrange(128_000) for _ in range(args.tokens)])
    seed = model_seed("bench-model")
    print(f"block keys of one {args.tokens:,}-token prompt, median of 7 x {args.repeat} calls")
    head = ("block size", "bytes/block", "blocks", "native", "per-block py", "ratio")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (10, 11, 7, 10, 13, 7), strict=True)))
    for block_size in (16, 32, 64, 256, 1024):
        native = keys._chain_keys(raw, block_size, seed)
        assert native == per_block_python(raw, block_size, seed), "native chain disagrees with xxhash"
        repeat = max(10, args.repeat * 16 // block_size)
        t_native = time_per_call(keys._chain_keys, (raw, block_size, seed), repeat)
        t_python = time_per_call(per_block_python, (raw, block_size, seed), max(10, repeat // 4))
        print(
            f"{block_size:>10} {block_size * 4:>11} {len(native):>7} {t_native * 1e6:>8.1f}µs "
            f"{t_python * 1e6:>11.1f}µs {t_python / t_native:>6.1f}x"
        )


if __name__ == "__main__":
    main()
