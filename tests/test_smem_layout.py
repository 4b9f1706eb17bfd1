"""common/tile/smem.py: a kernel's shared-memory regions, declared once, give the launch's bytes and the
kernel's offsets; the variants' layouts hold what their kernels put there."""
import pytest

from common.tile.smem import SharedLayout
from variants import fa1, fa2, fa2_backward


def test_regions_follow_each_other_16_byte_aligned():
    layout = SharedLayout(("q", 100, 2), ("empty", 0, 2), ("stats", 3, 4), ("kv", 8, 2))
    assert layout.start("q") == 0 and layout.end("q") == 100
    assert layout.start("empty") == layout.end("empty") == 208 // 2     # 200 bytes, aligned up
    assert layout.start("stats") == 208 // 4 and layout.end("stats", 4) == 220 // 4
    assert layout.start("kv") == 224 // 2 and layout.bytes == 224 + 16
    assert layout.start("stats", 2) == 104      # in another width
    with pytest.raises(ValueError, match="'q' declared twice"):
        SharedLayout(("q", 1, 2), ("q", 1, 2))


def test_variant_layouts_hold_their_tiles():
    """The bytes each default configuration launches with: the sum of its tiles, as the kernels
    lay them out (FA2's forward: Q_i and the K/V buffers; its backward: K_j, V_j, two stages of
    Q_i and dO_i, the dS^T and P^T tiles, the row statistics and, with bulk reductions, dQ_i's
    terms; FA1: K_j, V_j, Q_i and split-K's fp32 exchange)."""
    cfg = fa2.default_config(128, "bfloat16", False)    # 128 x 64 tiles, one K/V stage
    assert cfg.smem_bytes() == 2 * 128 * (128 + 2 * 64)
    cfg = fa2.default_config(64, "bfloat16", True)      # two stages
    assert cfg.smem_bytes() == 2 * 64 * (128 + 4 * 64)
    b = fa2_backward.default_backward_config(128, "bfloat16", False)  # B_r 64, B_c 128, 2-D tiles, bulk
    tiles16 = 128 * (2 * 128 + 4 * 64) + 3 * 128 * 64
    assert b.smem_bytes() == 2 * tiles16 + 4 * (4 * 64 + 64 * 128)
    layout = b.smem_layout()
    assert layout.start("stats") * 4 == 2 * tiles16 and layout.start("dq") == layout.end("stats")
    f = fa1.default_config(64, "bfloat16", False)       # B_r 16, B_c 256, 4 warps
    assert f.smem_bytes() == 2 * 64 * (2 * 256 + 2 * 16) + 4 * 4 * 16 * (64 + 8 + 2)
