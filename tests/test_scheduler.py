"""common/tile/scheduler.py, the persistent tile scheduler fa3's forward deals its tiles with: a
tiny kernel walks each block's tiles with the scheduler's own device functions (plan, next_tile,
the K/V head's divider), and the host checks the walks: every (query block, batch, head) tile
visited exactly once across the blocks, each block's last tile marked final, pairs of equal work
(causal), causal tiles longest first, a head's query blocks side by side; for grids of one
block, a few, and a block a work item (no persistence), on the GPU or in the simulator."""
from functools import lru_cache

import numpy as np
import pytest
from numba import cuda, int32

from common.hardware.target import kernel
from common.tile import scheduler

FIELDS = 6   # go, i, b, h, final, h_kv of a step of a walk


@lru_cache(maxsize=None)
def walk_kernel(block_m, paired, causal):
    s = scheduler.tile_scheduler(block_m, paired, causal)
    plan_of, next_tile = s.plan, s.next_tile
    divmod_by = scheduler.divmod_by

    @kernel
    def walk(n_q, heads, batch_heads, kv_group, out, lengths):
        if cuda.threadIdx.x == 0:
            plan = plan_of(n_q, heads, batch_heads, kv_group)
            lengths[cuda.blockIdx.x] = plan[0]
            for k in range(plan[0]):
                go, i, b, h, final = next_tile(k, plan)
                row = out[cuda.blockIdx.x, k]
                row[0], row[1], row[2], row[3] = go, i, b, h
                row[4], row[5] = int32(final), divmod_by(h, plan[5])[0]
                if go < 0:
                    break

    return walk


def walks(n_q, heads, batch, kv_group, block_m, paired, causal, grid):
    """{block: [(go, i, b, h, final, h_kv), ...]} of each block's walk, to its first go = -1."""
    n_blocks = -(-n_q // block_m)
    items = scheduler.work_items(n_blocks, batch * heads, paired)
    room = 2 * (-(-items // grid)) + 1
    out = cuda.to_device(np.full((grid, room, FIELDS), -7, np.int32))
    lengths = cuda.to_device(np.zeros(grid, np.int32))
    walk_kernel(block_m, paired, causal)[grid, 1](np.int32(n_q), np.int32(heads),
                                                  np.int32(batch * heads), np.int32(kv_group),
                                                  out, lengths)
    out, lengths = out.copy_to_host(), lengths.copy_to_host()
    got = {}
    for c in range(grid):
        assert lengths[c] == (2 if paired else 1) * (-(-items // grid))   # rounds x tiles an item
        steps = []
        for row in out[c, :lengths[c]]:
            steps.append(tuple(int(x) for x in row))
            if row[0] < 0:
                break
        got[c] = steps
    return got, n_blocks, items


# (n_q, heads, batch, kv_group, block_m): odd and even query-block counts, one block, GQA
PROBLEMS = [(320, 3, 2, 3, 64), (256, 2, 1, 1, 128), (100, 1, 3, 1, 128), (192, 4, 1, 2, 64)]
MODES = [(True, True), (False, True), (False, False)]   # (paired, causal)


@pytest.mark.parametrize("paired, causal", MODES, ids=["paired", "causal", "non-causal"])
@pytest.mark.parametrize("problem", PROBLEMS,
                         ids=lambda p: "n_q={} H={} B={} g={} B_r={}".format(*p))
@pytest.mark.parametrize("grid", [1, 3, None], ids=["one-block", "three-blocks", "a-block-an-item"])
def test_every_tile_once(problem, paired, causal, grid):
    n_q, heads, batch, kv_group, block_m = problem
    n_blocks = -(-n_q // block_m)
    items = scheduler.work_items(n_blocks, batch * heads, paired)
    grid = items if grid is None else grid
    got, n_blocks, items = walks(n_q, heads, batch, kv_group, block_m, paired, causal, grid)
    tiles = [(i, b, h) for c in got for go, i, b, h, _, _ in got[c] if go == 1]
    want = {(i, b, h) for i in range(n_blocks) for b in range(batch) for h in range(heads)}
    assert len(tiles) == len(want) and set(tiles) == want
    empty = sum(go == 0 for c in got for go, *_ in got[c])
    assert empty == (batch * heads if paired and n_blocks % 2 else 0)   # odd counts' middles
    for c, steps in got.items():
        real = [s for s in steps if s[0] == 1]
        assert [s[4] for s in real] == [0] * (len(real) - 1) + [1] * bool(real)   # final: the last
        assert all(s[5] == s[3] // kv_group for s in real)                         # the K/V head
        assert all(s[0] >= 0 for s in steps[:-1])                                 # -1 ends it
    if paired:   # a work item: one head's query blocks n - 1 - q, then q (the longer first)
        for c, steps in got.items():
            for first, second in zip(steps[0::2], steps[1::2]):
                if first[0] != 1:
                    continue
                assert first[1] >= n_blocks - 1 - first[1]
                if second[0] == 1:
                    assert second[1:4] == (n_blocks - 1 - first[1],) + first[2:4]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_the_order_of_the_deal(causal):
    """Unpaired: round r gives items r G .. r G + G - 1 to the blocks, forwards then backwards;
    item w is query block n - 1 - w // BH of head w % BH (causal: longest first) or query block
    w % n of head w // n (a head's blocks side by side)."""
    n_q, heads, batch, block_m, grid = 320, 3, 2, 64, 4
    got, n_blocks, items = walks(n_q, heads, batch, 1, block_m, False, causal, grid)
    bh_count = batch * heads
    for c, steps in got.items():
        for r, (go, i, b, h, _, _) in enumerate(steps):
            w = r * grid + (c if r % 2 == 0 else grid - 1 - c)
            if w >= items:
                assert go == -1
                continue
            bh = b * heads + h
            if causal:
                assert (i, bh) == (n_blocks - 1 - w // bh_count, w % bh_count)
            else:
                assert (i, bh) == (w % n_blocks, w // n_blocks)


def test_work_items_count():
    assert scheduler.work_items(5, 6, True) == 18     # 3 pairs (the middle alone) a head
    assert scheduler.work_items(4, 6, True) == 12
    assert scheduler.work_items(5, 6, False) == 30
