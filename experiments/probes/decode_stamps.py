"""(Probe, as it ran on the GPU host: python experiments/probes/decode_stamps.py L1,L2 S1,S2 from the
repository root.) Where a split block's time goes in decoding at batch 1 (issue 22;
docs/results/decode_epilogue_h100.txt): the split kernel with combine="fused" built with its
%globaltimer_lo stamps (ns, one timer for every SM) compiled in (variants/decoding.py:
build(cfg, stamps=True), common/hardware/stamps.py's timer_stamper), which decoding.decode launches
here in place of the plain build (the kernel cache is off, so no stamped cubin is kept; a stamped
kernel's key differs from the plain one's anyway), writes into spare words of the fused combine's
counter array (decoding.stamp_offsets): every block's start, when its first K/V tile landed and
when its partials were stored and fenced, and, for the last block of each (sequence, K/V head),
its loop's end, the ticket, the second fence and the end of its merge. B=1, 32 query heads on 8
K/V heads, d=128, bf16, pages of 256. The splits S: 2 or more (one split has no combine)."""
import os
import sys

os.environ["FA_KERNEL_CACHE"] = ""   # the stamped kernels must not meet the real ones' cubins
sys.path.insert(0, os.getcwd())
import common  # noqa: E402

common.select_backend()
import numpy as np  # noqa: E402
import torch  # noqa: E402

from variants import decoding  # noqa: E402

_build = decoding.build


def stamped_build(cfg):
    """decoding's split kernel of cfg with the stamps compiled in: decoding.decode builds its
    split kernel by the name decoding.build, which this probe points here."""
    return _build(cfg, stamps=True)


decoding.build = stamped_build

H, HKV, D, PS, B = 32, 8, 128, 256, 1
LENGTHS = [int(x) for x in sys.argv[1].split(",")]
SPLITS = [int(x) for x in sys.argv[2].split(",")]
if min(SPLITS) < 2:
    raise SystemExit("the stamps are the fused combine's: every S must be 2 or more")
# the counter array, laid out as [tickets (B H_kv) | each block's start and stored stamps |
# each group's last block's 8 words | each block's first-tile stamp]: room for it
decoding.split_counters("torch", torch.empty(1, device="cuda"),
                        decoding.stamp_offsets(B * HKV, max(SPLITS))[3])
arr = decoding._COUNTERS[("torch", 0)][1]
for L in LENGTHS:
    kc = torch.randn(B * L // PS, PS, HKV, D, device="cuda", dtype=torch.bfloat16); vc = torch.randn_like(kc)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(B * L // PS, device="cuda").to(torch.int32).reshape(B, -1).contiguous()
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    for S in SPLITS:
        for rep in range(4):
            decoding.decode(q, kc, vc, lens, block_table=table, check=False, num_splits=S, combine="fused")
        torch.cuda.synchronize()
        c = arr.copy_to_host().astype(np.int64)
        NC = B * HKV
        nb = NC * S
        pairs, last_at, first_at, _ = decoding.stamp_offsets(NC, S)
        se = c[pairs:pairs + 2 * nb].reshape(nb, 2)
        t0 = se[:, 0].min()

        def rel(x, t0=t0):   # us after the first block's start (the stamps wrap at 2^32 ns)
            return ((x - t0) % (1 << 32)) / 1000.0

        ends = rel(se[:, 1])
        starts = rel(se[:, 0])
        last = c[last_at:last_at + decoding.STAMP_LAST_WORDS * NC].reshape(NC, decoding.STAMP_LAST_WORDS)
        tf = rel(c[first_at:first_at + nb])
        print(f"L={L} S={S} : block starts {starts.min():.2f}-{starts.max():.2f} us, "
              f"step-2 ends (after fence b) median {np.median(ends):.2f} max {ends.max():.2f} us")
        print(f"   first tile landed (after its wait): min {tf.min():.2f} median {np.median(tf):.2f} max {tf.max():.2f} us")
        for g in range(NC):
            t = [rel(x) for x in last[g, :7]]
            print(f"   group {g} last split {last[g, 7]:3d}: start {t[0]:6.2f} loop-end {t[1]:6.2f} stored {t[2]:6.2f} "
                  f"fenced {t[3]:6.2f} ticket {t[4]:6.2f} fence-f {t[5]:6.2f} merged {t[6]:6.2f}")
