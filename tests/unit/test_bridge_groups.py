"""KV-cache groups in the bridge's translator (workers_shim/bridges/translate.py): every group indexed
and published as itself, the layout learned from the stores, sparse groups' blocks placed by
translations or vLLM's recomputed hash (never guessed), bad group input counted. The sink is the
publisher's real transport-free core (WorkerLog), so what is checked is what would go on the wire."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from kvindex.keys import block_keys, group_key
from kvindex.wire.groups import parse_groups
from workers_shim.bridges.native import Ignored, NativeRemoved, NativeStored
from workers_shim.bridges.stats import BridgeStats
from workers_shim.bridges.translate import VLLM_NONE_HASH, Translator, vllm_block_digests
from workers_shim.publisher import WorkerLog

MODEL = "hybrid-test"
BS = 4
SW = {"kind": "sliding_window", "sliding_window": 8}  # window 8: two blocks of 4
FULL = {"kind": "full_attention"}
TOKENS = list(range(100, 100 + 7 * BS))  # seven full blocks
KEYS = block_keys(TOKENS, BS, MODEL)
# Engine hashes: one per block of TOKENS (the same in every group, as vLLM's are).
H = [int.from_bytes(hashlib.sha256(f"h{i}".encode()).digest()[:8], "big") for i in range(7)]


class Quiet:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def translator(**kw: Any) -> tuple[Translator, WorkerLog, BridgeStats]:
    log = WorkerLog(worker="w1", model=MODEL, block_size=BS)
    stats = BridgeStats(log=Quiet())
    return Translator(MODEL, BS, log, stats, **kw), log, stats


def stored(
    hashes: list[Any], parent: Any, tokens: list[int], group: int | None = None, **kw: Any
) -> NativeStored:
    return NativeStored(hashes, parent, list(tokens), kw.pop("block_size", BS), "gpu", group=group, **kw)


def apply_batch(t: Translator, *events: Any) -> None:
    t.prepare(events)
    for ev in events:
        assert t.apply(ev)


def held(log: WorkerLog, group: int) -> set[int]:
    """Indices (into KEYS) of the blocks ``group`` holds on the GPU."""
    return {i for i, k in enumerate(KEYS) if group_key(k, group) in log.blocks["gpu"]}


def skipped(stats: BridgeStats) -> dict[str, int]:
    return stats.snapshot().get("skipped", {})


def gemma_step(first: int = 0, n: int = 7, kept: tuple[int, ...] = (5, 6)) -> list[NativeStored]:
    """What vLLM publishes for one step of a Gemma-3-like model (groups 0-1 sliding window, 2 full):
    the sliding-window groups first, each listing only the blocks it keeps of the range."""
    parent = H[first - 1] if first else None
    tokens = TOKENS[first * BS : (first + n) * BS]
    sparse = [stored([H[i] for i in kept], parent, tokens, g, **SW) for g in (0, 1)]
    return [*sparse, stored(H[first : first + n], parent, tokens, 2, **FULL)]


def test_sparse_groups_stored_before_the_full_group_land_at_their_blocks() -> None:
    t, log, stats = translator()
    apply_batch(t, *gemma_step())
    assert held(log, 0) == held(log, 1) == {5, 6}
    assert held(log, 2) == set(range(7))
    assert skipped(stats) == {}
    # The layout, in group order, as heartbeats announce it (and the index parses it).
    assert log.groups == [
        {"kind": "sliding_window", "block_size": BS, "window": 8},
        {"kind": "sliding_window", "block_size": BS, "window": 8},
        {"kind": "full_attention", "block_size": BS},
    ]
    assert [s.kind for s in parse_groups(log.groups, BS)] == ["sliding_window"] * 2 + ["full_attention"]
    # The wire: stored events carry the group (0 is left out) and the plain keys, the sliding window's
    # chain continuing from the block before it.
    events = [ev for _, data in log.seal() for ev in _events(data)]
    sw = [ev for ev in events if ev.get("group") == 1]
    assert sw == [{"type": "stored", "tier": "gpu", "keys": KEYS[5:7], "parent": KEYS[4], "group": 1}]


def _events(data: bytes) -> list[dict[str, Any]]:
    import msgpack

    return msgpack.unpackb(data)["events"]


def test_a_sparse_store_of_a_later_batch_is_placed_by_earlier_translations() -> None:
    t, log, stats = translator()
    apply_batch(t, *gemma_step(n=4, kept=(2, 3)))
    # The next step: blocks 4-6, the window keeps 5 and 6; the full group's store comes in a later
    # batch here, so the earlier translations cannot help and vLLM's hash does not apply (these are
    # not vLLM's hashes): unplaced, counted, nothing guessed.
    sparse = [stored([H[5], H[6]], H[3], TOKENS[16:28], g, **SW) for g in (0, 1)]
    apply_batch(t, *sparse)
    assert held(log, 0) == held(log, 1) == {2, 3}
    assert skipped(stats) == {"unplaced_block": 4}
    apply_batch(t, stored(H[4:7], H[3], TOKENS[16:28], 2, **FULL))
    # Once the full group translated them, the same sparse store places its blocks.
    apply_batch(t, *sparse)
    assert held(log, 0) == held(log, 1) == {2, 3, 5, 6}


def test_a_translation_that_is_not_a_block_of_the_range_is_not_placed() -> None:
    t, log, stats = translator()
    apply_batch(t, *gemma_step())
    other = list(range(900, 900 + 3 * BS))
    # A sliding-window store of another range naming a hash the map knows as block 6 of TOKENS.
    apply_batch(t, stored([H[6]], None, other, 0, **SW))
    assert held(log, 0) == {5, 6}
    assert skipped(stats) == {"unplaced_block": 1}
    assert not any(group_key(k, 0) in log.blocks["gpu"] for k in block_keys(other, BS, MODEL))


def vllm_hashes(tokens: list[int], parent: bytes = VLLM_NONE_HASH) -> list[int]:
    return [int.from_bytes(d, "big") & ((1 << 64) - 1) for d in vllm_block_digests(parent, tokens, BS)]


def test_pure_mamba_is_placed_by_vllms_own_hash() -> None:
    """A model with no group that lists every block (vLLM's Mamba-2): one 4-token step at a time, the
    state kept only at the prompt's end; vLLM's sha256 chain locates the hashes."""
    t, log, stats = translator()
    vh = vllm_hashes(TOKENS)
    mamba = {"kind": "mamba"}
    for i in range(7):
        parent = vh[i - 1] if i else None
        kept = [vh[i]] if i == 6 else []
        apply_batch(t, stored(kept, parent, TOKENS[i * BS : (i + 1) * BS], 0, **mamba))
    assert held(log, 0) == {6}
    assert skipped(stats) == {}
    assert log.groups == [{"kind": "mamba", "block_size": BS}]
    # A sparse store over several blocks: the hash locates the kept one.
    t, log, stats = translator()
    apply_batch(t, stored([vh[3], vh[6]], None, TOKENS, 0, **mamba))
    assert held(log, 0) == {3, 6}


def test_pure_mamba_with_another_hash_algorithm_places_nothing() -> None:
    t, log, stats = translator()
    apply_batch(t, stored([H[3], H[6]], None, TOKENS, 0, kind="mamba"))
    assert held(log, 0) == set()
    assert skipped(stats) == {"unplaced_block": 2}


def test_refcounts_are_per_group() -> None:
    t, log, stats = translator()
    apply_batch(t, *gemma_step())
    apply_batch(t, NativeRemoved([H[6]], "gpu", group=0))
    assert held(log, 0) == {5}
    assert held(log, 1) == {5, 6}
    assert 6 in held(log, 2)
    # A second physical copy in group 1 (vLLM keeps duplicates): one removal leaves it held.
    apply_batch(t, stored([H[6]], H[5], TOKENS[24:28], 1, **SW))
    apply_batch(t, NativeRemoved([H[6]], "gpu", group=1))
    assert held(log, 1) == {5, 6}
    apply_batch(t, NativeRemoved([H[6]], "gpu", group=1))
    assert held(log, 1) == {5}
    assert skipped(stats) == {}


def test_layout_is_announced_once_contiguous_from_group_zero() -> None:
    t, log, _ = translator()
    apply_batch(t, stored(H[:2], None, TOKENS[:8], 1, **FULL))
    assert log.groups is None  # group 0 not named yet
    apply_batch(t, stored([H[1]], None, TOKENS[:8], 0, **SW))
    assert log.groups is not None and [g["kind"] for g in log.groups] == ["sliding_window", "full_attention"]


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        # A group index but no kind, for a group whose kind is unknown (other groups named theirs).
        (stored(H[:2], None, TOKENS[:8], 3), "group_without_kind"),
        # The window of a group changes between events.
        (
            stored([H[1]], None, TOKENS[:8], 0, kind="sliding_window", sliding_window=16),
            "group_spec_mismatch",
        ),
        # The kind of a group changes.
        (stored(H[:2], None, TOKENS[:8], 0, **FULL), "group_spec_mismatch"),
        # A sliding window without its window.
        (stored([H[1]], None, TOKENS[:8], 4, kind="sliding_window"), "bad_group"),
        (stored(H[:2], None, TOKENS[:8], 1024, **FULL), "bad_group"),
        (stored(H[:2], None, TOKENS[:8], -1, **FULL), "bad_group"),
        # Another block size than the group's (and the bridge's).
        (stored(H[:1], None, TOKENS[:8], 2, block_size=8, **FULL), "block_size_mismatch"),
        # Removals of a group never stored, and of a group out of range.
        (NativeRemoved([H[0]], "gpu", group=7), "unknown_group_removed"),
        (NativeRemoved([H[0]], "gpu", group=5000), "bad_group"),
    ],
)
def test_bad_group_input_is_counted_and_loses_nothing_else(event: Any, reason: str) -> None:
    t, log, stats = translator()
    apply_batch(t, *gemma_step())
    before = set(log.blocks["gpu"])
    layout = list(log.groups or [])
    apply_batch(t, event)
    assert skipped(stats) == {reason: len(event.hashes)}
    assert log.blocks["gpu"] == before
    assert log.groups == layout
    # What follows is applied as usual.
    apply_batch(t, NativeRemoved([H[6]], "gpu", group=2))
    assert 6 not in held(log, 2)


def test_kv_group_override_indexes_one_group_as_group_zero() -> None:
    t, log, stats = translator(kv_group=2)
    apply_batch(t, *gemma_step())
    assert held(log, 0) == set(range(7))  # the full-attention group, published as group 0
    assert log.groups is None  # no layout: the index reads one cache, approximately
    assert skipped(stats) == {"other_kv_group": 4}


def test_an_engine_naming_groups_without_kinds_is_indexed_as_before() -> None:
    """Older vLLM put group_idx (0) on events but no kind: group 0 is indexed, no layout announced."""
    t, log, stats = translator()
    apply_batch(t, stored(H[:3], None, TOKENS[:12], 0), NativeRemoved([H[2]], "gpu", group=0))
    assert held(log, 0) == {0, 1}
    assert log.groups is None
    assert skipped(stats) == {}


def test_chunked_local_attention_announces_the_chunk_given() -> None:
    for chunk, expected in (
        (8, [{"kind": "chunked_local_attention", "block_size": BS, "chunk": 8}]),
        (None, None),
    ):
        t, log, _ = translator(attention_chunk=chunk)
        apply_batch(t, stored(H[:2], None, TOKENS[:8], 0, kind="chunked_local_attention"))
        # Without the chunk the layout still goes out (the index then says approximate).
        assert log.groups == (expected or [{"kind": "chunked_local_attention", "block_size": BS}])


def test_trtllm_windows_become_groups() -> None:
    """TensorRT-LLM (variable sliding window): one cache per window size, named on every event; the
    largest window is full attention, window -1 the linear-attention state."""
    t, log, stats = translator()
    apply_batch(t, *(Ignored("created", attention_window=w) for w in (-1, 8, 4096)))
    assert log.groups == [
        {"kind": "mamba", "block_size": BS},
        {"kind": "sliding_window", "block_size": BS, "window": 8},
        {"kind": "full_attention", "block_size": BS},
    ]
    apply_batch(
        t,
        stored(H[:4], None, TOKENS[:16], attention_window=4096),
        stored(H[:2], None, TOKENS[:8], attention_window=8),
    )
    assert held(log, 2) == {0, 1, 2, 3}
    assert held(log, 1) == {0, 1}
    apply_batch(t, NativeRemoved([H[1]], "gpu", attention_window=8))
    assert held(log, 1) == {0}
    assert skipped(stats) == {}


def test_a_resync_keeps_the_layout_of_the_same_engine() -> None:
    old, _, _ = translator()
    apply_batch(old, *gemma_step())
    t, log, _ = translator()
    t.inherit(old)
    assert log.groups == old.layout and log.groups is not None


_VLLM = ["vllm", "--zmq", "tcp://h:5557", "--worker-id", "w", "--model", "m"]


def _config(*args: str) -> Any:
    from workers_shim.cli import build_parser, config_from_args

    return config_from_args(build_parser()[0].parse_args([*_VLLM, *args]))


def test_every_group_by_default_and_the_chunk_from_the_flags(tmp_path: Any) -> None:
    assert (_config().kv_group, _config().attention_chunk) == (None, None)
    assert _config("--kv-group", "3").kv_group == 3
    llama4 = tmp_path / "config.json"
    llama4.write_text(
        '{"architectures": ["Llama4ForConditionalGeneration"], "text_config": {"attention_chunk_size": 8192}}'
    )
    assert _config("--model-config", str(llama4)).attention_chunk == 8192
    assert _config("--model-config", str(llama4), "--attention-chunk", "64").attention_chunk == 64
    plain = tmp_path / "plain.json"
    plain.write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert _config("--model-config", str(plain)).attention_chunk is None


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--kv-group", "1024"], "--kv-group"),
        (["--kv-group", "-1"], "--kv-group"),
        (["--kv-group", "full"], "--kv-group"),
        (["--attention-chunk", "0"], "--attention-chunk"),
        (["--model-config", "/nonexistent/config.json"], "--model-config"),
    ],
)
def test_group_flag_mistakes_exit_2_naming_the_flag(
    args: list[str], flag: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from workers_shim.cli import main

    with pytest.raises(SystemExit) as exc:
        main([*_VLLM, *args])
    assert exc.value.code == 2
    assert f"error: argument {flag}: " in capsys.readouterr().err


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"attention_chunk_size": -4}'])
def test_an_unusable_model_config_exits_2(
    text: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from workers_shim.cli import main

    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        main([*_VLLM, "--model-config", str(path)])
    assert exc.value.code == 2
    assert "error: argument --model-config: " in capsys.readouterr().err
