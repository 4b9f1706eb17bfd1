"""(Probe.) Where a consumer warpgroup's K/V step goes in fa3's forward, in SM cycles: the
forward's kernel built with its timing stamps compiled in (variants/fa3.py: build(cfg,
stamps=True), %clock reads from common/hardware/stamps.py in the default step loop: no
intra-warpgroup overlap, not back to back, the loop FP8 and bf16 run by default), with the kernel
cache off (so no stamped cubin is kept), one call timed after warm-up:

    python experiments/probes/fa3_phases.py SEQLEN CAUSAL(0|1) [fp8|bf16] ['{"option": value}']

(GPU host, torch; in the simulator, NUMBA_ENABLE_CUDASIM=1, with a small SEQLEN: the stand-in
clock is the host's nanoseconds, a check of the plumbing only.) Per consumer warp, the cycles a
step spends in each phase, summed over the call:

    wait K     the wait for K_j's full barrier (and the loop's own overhead since the last stamp)
    S issue    S_j = Q K_j^T issued (fence, descriptors, wgmma; FP8's per-block K scale loaded)
               and the turn passed on
    wait S     until S_j has landed
    softmax    logits (softcap, mask), the online softmax (FP8's K scales folded in), P~ into the
               A registers
    wait V     the wait for V_j's full barrier
    wait turn  the ping-pong's turn (the other warpgroup's GEMMs issued)
    P V        O += P~ V_j issued and waited for, V_j released
  and a tile's, outside the step loop:
    finalize   from the last step to O scaled by 1/l (the turn passed on, l summed across the
               row's lanes, 1/l and L)
    stage O    O into shared memory as 16-bit pairs, between the warpgroup's two barriers
               (o_store="bulk", "tma": after the wait for the last tile's copies to read the room)
    store O    O stored (16-byte stores; o_store="bulk", "tma": the copies issued), Q's room
               released (O in Q's room), L written
    schedule   from there (or the kernel's start) to the next tile's wait for Q_i: the tile
               scheduler's arithmetic, the sequence's bounds, O and the statistics cleared,
               FP8's descale loads issued
    wait Q     the wait for Q_i's full barrier
    turn       from Q_i to the step loop: the ping-pong's first turn of the tile

Each warp leaves its totals in its own 16 LSE rows of the block's last tile, over the LSE the
epilogue wrote there (fa3.stamp_record: a marker, the block, warp and tiles packed, steps, the 13
sums; the call's LSE is therefore not the attention's). Stamps order only
with the instructions that have side effects (barrier waits, wgmma issue and waits): ptxas may
move some pure arithmetic of the softmax across the softmax's own two stamps. The stamps add ~40
instructions to a step of ~1 000 (FP8, d=128; causal, ptxas also spills a few bytes). d=128,
batch x seqlen = 16k, 16 heads (the FA2 paper's shapes). docs/results/fa3_phases_h100.txt ran
the first version, whose one "tile" column is the sum of the last six here; fa3_tile_h100.txt
this one (the versions between wrote a record every tile, timed in the next tile's "schedule")."""
import json
import os
import sys

os.environ["FA_KERNEL_CACHE"] = ""   # the stamped kernels must not meet the real ones' cubins
sys.path.insert(0, os.getcwd())
import common  # noqa: E402

MODE = common.select_backend()
import numpy as np  # noqa: E402

from variants import fa3  # noqa: E402

PHASES = ("wait K", "S issue", "wait S", "softmax", "wait V", "wait turn", "P V",
          "finalize", "stage O", "store O", "schedule", "wait Q", "turn")
assert len(PHASES) == fa3.STAMP_PHASES
TILE_PHASES = 6   # the last six: a tile's, outside the step loop
MARK = fa3.STAMP_MARK   # a record's first word (no LSE is this)

_build = fa3.build


def stamped_build(cfg):
    """fa3's kernel of cfg with the stamps compiled in: fa3.forward's launch (fa3._run) builds
    its kernel by the name fa3.build, which this probe points here."""
    return _build(cfg, stamps=True)


fa3.build = stamped_build


def records(lse):
    """{(block, warp): (steps, tiles, sums)}: each warp's record (block, warp and tiles packed
    into one float: 8 + 4 + 12 bits, exact in float32)."""
    flat = lse.reshape(-1)
    out = {}
    for at in np.flatnonzero(flat == np.float32(MARK)):
        if flat[at + 1] >= 2 ** 24:
            raise SystemExit("a record's block, warp and tile count do not fit its float (more "
                             "than 255 blocks: the probe reads persistent runs only)")
        packed, steps = int(flat[at + 1]), int(flat[at + 2])
        block, warp, tiles = packed >> 16, (packed >> 12) & 15, packed & 4095
        out[block, warp] = (steps, tiles, flat[at + 3:at + 3 + len(PHASES)].astype(np.float64))
    return out


def main(n, causal, dtype, options):
    from common.hardware import target
    from experiments.measure import inputs
    from variants import fp8
    if n % 128:   # a warp records at its block's last tile, from 16 whole LSE rows of it
        raise SystemExit(f"seqlen {n}: the probe takes a multiple of 128 (B_r), so that every "
                         "warp's last tile holds its record")
    b, h, d = (max(1, 16384 // n), 16, 128) if MODE == "gpu" else (1, 2, 128)
    q, k, v = (inputs.to_device(x, inputs.default_library()) for x in
               inputs.random_qkv(np.random.default_rng(0), b, n, h, d, "bfloat16"))
    if dtype == "fp8":
        (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize_fp8(x, block=None) for x in (q, k, v))

        def call():
            return fa3.forward(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                               v_descale=vd, **options)
    else:
        def call():
            return fa3.forward(q, k, v, causal=causal, **options)
    for _ in range(1 if MODE != "gpu" else 3):
        call()
    _, lse = call()
    got = records(inputs.to_host(lse))
    if not got:
        raise SystemExit("no record: the default step loop did not run (intra_overlap or "
                         "back_to_back on?)")
    print(f"# {target.describe()}; fa3 {dtype} d={d}, seqlen {n}, batch {b}, {h} heads, "
          f"causal={causal}, options {json.dumps(options)}; cycles a step (the last six: a tile)")
    print(f"{'warps':>10s} {'steps':>6s} " + " ".join(f"{p:>9s}" for p in PHASES)
          + "  step total tile total")
    for wg in sorted({w // 4 for _, w in got if w < 8}):
        rows = [r for (blk, w), r in got.items() if w // 4 == wg]
        steps = sum(r[0] for r in rows)
        tiles = sum(r[1] for r in rows)
        sums = sum(r[2] for r in rows)
        cut = len(PHASES) - TILE_PHASES
        per = [x / max(steps, 1) for x in sums[:cut]] + [x / max(tiles, 1) for x in sums[cut:]]
        print(f"{'wg ' + str(wg):>10s} {steps / len(rows):6.1f} " + " ".join(f"{x:9.0f}" for x in per)
              + f"  {sum(per[:cut]):9.0f} {sum(per[cut:]):9.0f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] if len(sys.argv) > 3 else "fp8",
         json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})
