"""Block keys: published vectors, an independent re-derivation from the spec text, and input forms."""

from __future__ import annotations

import json
import struct
from array import array

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvindex.keys import (
    MAX_GROUPS,
    block_keys,
    group_key,
    group_mask,
    keys_from_le_bytes,
    model_seed,
    tokens_to_le_bytes,
)
from tests.conftest import ROOT

VECTORS = json.loads((ROOT / "proto" / "vectors" / "block_keys.json").read_text())["vectors"]


def spec_keys(
    tokens: list[int], block_size: int, model: str, lora: str | None, salt: str | None
) -> list[int]:
    """The key definition of docs/wire.md, written out directly (no shared code with kvindex.keys)."""
    seed = xxhash.xxh3_64_intdigest(
        model.encode("utf-8") + b"\0" + (lora or "").encode("utf-8") + b"\0" + (salt or "").encode("utf-8")
    )
    keys, prev = [], seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        prev = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *block), seed=prev)
        keys.append(prev)
    return keys


def test_at_least_three_published_vectors() -> None:
    assert len([v for v in VECTORS if v["keys"]]) >= 3


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_published_vectors(vector: dict) -> None:
    assert model_seed(vector["model"], vector["lora"], vector["salt"]) == vector["seed"]
    got = block_keys(vector["tokens"], vector["block_size"], vector["model"], vector["lora"], vector["salt"])
    assert got == vector["keys"]
    assert (
        spec_keys(vector["tokens"], vector["block_size"], vector["model"], vector["lora"], vector["salt"])
        == got
    )
    assert len(got) == len(vector["tokens"]) // vector["block_size"]


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    block_size=st.integers(1, 9),
    lora=st.none() | st.text(max_size=5),
    salt=st.none() | st.text(max_size=5),
)
def test_matches_spec_for_any_prompt(
    tokens: list[int], block_size: int, lora: str | None, salt: str | None
) -> None:
    assert block_keys(tokens, block_size, "model-x", lora, salt) == spec_keys(
        tokens, block_size, "model-x", lora, salt
    )


@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=64), cut=st.integers(1, 7))
def test_parent_continues_the_chain(tokens: list[int], cut: int) -> None:
    bs = 4
    whole = block_keys(tokens, bs, "m")
    head = block_keys(tokens[: cut * bs], bs, "m")
    if len(head) < cut:
        return
    tail = block_keys(tokens[cut * bs :], bs, "m", parent=head[-1])
    assert head + tail == whole


def test_namespaces_are_separate() -> None:
    toks = list(range(32))
    base = block_keys(toks, 16, "m")
    assert block_keys(toks, 16, "m", lora="a") != base
    assert block_keys(toks, 16, "m", salt="s") != base
    assert block_keys(toks, 16, "m2") != base
    # The NUL separator keeps ("ab", "") and ("a", "b") apart.
    assert model_seed("ab", "") != model_seed("a", "b")


def test_equal_keys_imply_equal_prefixes() -> None:
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, "m")
    b = block_keys([9, 9, 9, 9, 5, 6, 7, 8], 4, "m")
    assert a[0] != b[0] and a[1] != b[1]  # same second block content, different prefix


def test_input_forms_agree() -> None:
    toks = [7, 0, 2**32 - 1, 12345, 99, 100, 101, 102]
    expected = block_keys(toks, 4, "m")
    assert block_keys(tuple(toks), 4, "m") == expected
    assert block_keys(np.array(toks, dtype=np.int64), 4, "m") == expected
    assert block_keys(np.array(toks, dtype=np.uint32), 4, "m") == expected
    assert block_keys(array("I", toks), 4, "m") == expected
    assert block_keys(struct.pack("<8I", *toks), 4, "m") == expected
    assert keys_from_le_bytes(tokens_to_le_bytes(toks), 4, model_seed("m")) == expected


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["x"]])
def test_bad_tokens_raise_value_error(bad: list) -> None:
    with pytest.raises(ValueError):
        block_keys(bad, 1, "m")
    with pytest.raises(ValueError):
        block_keys(np.array(bad) if not isinstance(bad[0], str) else bad, 1, "m")


def test_bad_block_size_and_byte_length() -> None:
    with pytest.raises(ValueError):
        block_keys([1, 2], 0, "m")
    with pytest.raises(ValueError):
        tokens_to_le_bytes(b"\x00\x01\x02")


def test_native_chain_is_built_and_agrees_with_the_python_loop() -> None:
    from kvindex import keys

    assert keys._chain_keys is not None, "kvindex/_keys_native.pyx was not compiled"
    raw = tokens_to_le_bytes(list(range(1000, 3000)))
    for block_size in (1, 4, 16, 33, 512):
        for cut in (0, 5, 4 * block_size, len(raw)):
            seed = model_seed("m", "l", "s")
            assert keys.keys_from_le_bytes(raw[:cut], block_size, seed) == keys._keys_python(
                raw[:cut], block_size, seed
            )


def test_own_xxh3_equals_the_xxhash_package_for_every_length_class() -> None:
    """kvindex/_xxh3.h against the xxhash package: every length 0..4096 bytes (0-16, 17-128, 129-240
    and the stripe-based long path with its 1024-byte blocks), each with seed 0 and a random seed."""
    import random

    from kvindex._keys_native import xxh3_64

    rng = random.Random(20261201)
    data = rng.randbytes(4096 + 64)
    for length in range(4097):
        start = rng.randrange(64)  # unaligned starts too
        chunk = data[start : start + length]
        for seed in (0, rng.getrandbits(64)):
            assert xxh3_64(chunk, seed) == xxhash.xxh3_64_intdigest(chunk, seed), (length, seed)


@given(data=st.binary(max_size=3000), seed=st.integers(0, 2**64 - 1))
def test_own_xxh3_equals_the_xxhash_package_on_random_inputs(data: bytes, seed: int) -> None:
    from kvindex._keys_native import xxh3_64

    assert xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed)


def test_native_chain_with_long_blocks_equals_the_spec() -> None:
    """Block sizes whose blocks take the mid-size and long hash paths (up to 1024 tokens = 4 KiB)."""
    tokens = list(range(7, 7 + 4 * 1024 + 5))
    for block_size in (33, 60, 64, 256, 1024):
        assert block_keys(tokens, block_size, "m") == spec_keys(tokens, block_size, "m", None, None)


def test_own_xxh3_portable_path_equals_the_xxhash_package(tmp_path) -> None:
    """The non-SSE2 path of kvindex/_xxh3.h (and the 128-bit multiply without __int128), built here
    with the C compiler the native extension was built with, on every length class."""
    import random
    import shutil
    import subprocess
    import sysconfig

    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    assert shutil.which(cc), f"no C compiler {cc!r} (the native extension needs one too)"
    driver = tmp_path / "xxh3_driver.c"
    driver.write_text(
        """
#include <stdio.h>
#include <stdlib.h>
#include "_xxh3.h"
int main(void) {
    static unsigned char buf[8192];
    unsigned long long seed; size_t len;
    while (scanf("%llu %zu", &seed, &len) == 2) {
        for (size_t i = 0; i < len; i++) { unsigned v; if (scanf("%2x", &v) != 1) return 2; buf[i] = v; }
        printf("%llu\\n", (unsigned long long)kvx_xxh3_64(buf, len, seed));
    }
    return 0;
}
"""
    )
    rng = random.Random(5)
    cases = [(rng.getrandbits(64) if i % 2 else 0, rng.randbytes(n)) for i, n in enumerate(range(0, 2100, 7))]
    stdin = "".join(f"{seed} {len(d)} {d.hex()}\n" for seed, d in cases)
    want = [xxhash.xxh3_64_intdigest(d, seed) for seed, d in cases]
    include = str(ROOT / "kvindex")
    for defines in (["-DKVX_SCALAR"], ["-DKVX_SCALAR", "-U__SIZEOF_INT128__"]):
        exe = tmp_path / "xxh3_driver"
        subprocess.run([cc, "-O2", *defines, "-I", include, str(driver), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True).stdout
        assert [int(x) for x in out.split()] == want, defines


GROUP_VECTORS = json.loads((ROOT / "proto" / "vectors" / "block_keys.json").read_text())["group_keys"]


@pytest.mark.parametrize("vector", GROUP_VECTORS["vectors"], ids=lambda v: f"group {v['group']}")
def test_group_key_vectors(vector: dict) -> None:
    """docs/wire.md §8, written out: G(0) = 0, G(g) = xxh3_64(u32 le g, seed 0); group key = key ^ G."""
    g = vector["group"]
    spec_mask = 0 if g == 0 else xxhash.xxh3_64_intdigest(struct.pack("<I", g))
    assert group_mask(g) == vector["mask"] == spec_mask
    assert group_key(vector["key"], g) == vector["group_key"] == vector["key"] ^ spec_mask


def test_group_masks_are_distinct_and_bounded() -> None:
    masks = [group_mask(g) for g in range(MAX_GROUPS)]
    assert len(set(masks)) == MAX_GROUPS and masks[0] == 0
    for bad in (-1, MAX_GROUPS):
        with pytest.raises(ValueError, match="KV-cache group"):
            group_mask(bad)
