"""The bridge's block-size check on SGLang's partial pages, without an engine or a socket. The rest
(learned, checked, a conflict stopping kvshim): tests/integration/test_bridge_block_size.py."""

from __future__ import annotations

from workers_shim.bridges import blocksize
from workers_shim.bridges.native import NativeStored


def test_sglang_partial_pages_are_not_a_conflict() -> None:
    def page(n_tokens: int, size: int) -> NativeStored:
        return NativeStored([1], None, list(range(n_tokens)), size, "gpu")

    seen = blocksize.evidence([page(16, 16), page(16, 16), page(5, 5)], kv_group=0)
    assert blocksize.learn(seen, partial_blocks=True) == 16
    assert blocksize.conflict(seen, 16, partial_blocks=True) is None
    assert blocksize.conflict(seen, 16, partial_blocks=False) == 5  # vLLM never stores short blocks
    assert blocksize.conflict(blocksize.evidence([page(32, 32)], 0), 16, partial_blocks=True) == 32
    # Stores of other KV groups, token-less placeholders and inconsistent ones tell nothing.
    other = NativeStored([1, 2], None, list(range(64)), 32, "gpu", group=1)
    tokenless = NativeStored([1], None, [], 0, "cpu")
    assert blocksize.evidence([other, tokenless, NativeStored([1, 2], None, [1, 2, 3], 0, "gpu")], 0) == []
    assert blocksize.evidence([NativeStored([1, 2], None, list(range(8)), 0, "gpu")], 0) == [(4, False)]
