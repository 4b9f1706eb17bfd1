"""(Probe, as it ran on the GPU host: python experiments/probes/decode_stamps.py L1,L2 S1,S2 from the
repository root.) Where a split block's time goes in decoding at batch 1 (issue 22;
docs/results/decode_epilogue_h100.txt): a copy of variants/decoding.py with %globaltimer_lo stamps
(ns) added to the split kernel with combine="fused", built as a module of its own (the kernel cache
is off, so no stamped cubin is kept), writes into spare words of the fused combine's counter array:
every block's start, when its first K/V tile landed and when its partials were stored and fenced,
and, for the last block of each (sequence, K/V head), its loop's end, the ticket, the second fence
and the end of its merge. B=1, 32 query heads on 8 K/V heads, d=128, bf16, pages of 256."""
import os
import sys
import types

os.environ["FA_KERNEL_CACHE"] = ""   # the stamped kernels must not meet the real ones' cubins
sys.path.insert(0, os.getcwd())
import common  # noqa: E402

common.select_backend()
import numpy as np  # noqa: E402
import torch  # noqa: E402

s = open(os.path.join("variants", "decoding.py")).read()


def sub(old, new):
    global s
    assert old in s, old
    s = s.replace(old, new, 1)


sub('''@lru_cache(maxsize=None)
def build_merge(''', '''if target.SIMULATOR:
    @device_function
    def gtimer():
        return int32(0)
else:
    from numba.cuda.extending import intrinsic as _intr
    from common.hardware._inline_asm import _asm as _asm2, _i32 as _i32b

    @_intr
    def gtimer(typingctx):
        sig = types.int32()

        def codegen(context, builder, sig, args):
            return _asm2(builder, _i32b, [], "mov.u32 $0, %globaltimer_lo;", "=r", side_effect=True)
        return sig, codegen


@lru_cache(maxsize=None)
def build_merge(''')
sub('''        tid = int32(cuda.threadIdx.x)
''', '''        tid = int32(cuda.threadIdx.x)
        T0 = gtimer()
''')
sub('''        # Merge the warps (as step 3 merges the splits).''', '''        T1 = gtimer()
        # Merge the warps (as step 3 merges the splits).''')
sub('''            ptx.cp_async_wait(TILE_LANDED)     # tile t has landed ...
            cuda.syncthreads()                 # ... and every warp is done with the one before
''', '''            ptx.cp_async_wait(TILE_LANDED)     # tile t has landed ...
            cuda.syncthreads()                 # ... and every warp is done with the one before
            if k == 0:
                TF = gtimer()
''')
sub('''            cuda.threadfence()                                                        # (b)
            cuda.syncthreads()                                                        # (c)
''', '''            T2 = gtimer()
            cuda.threadfence()                                                        # (b)
            cuda.syncthreads()                                                        # (c)
            T3 = gtimer()
            NC = int32(cuda.gridDim.y * cuda.gridDim.z)
            lin = (b * int32(cuda.gridDim.z) + h_kv) * int32(cuda.gridDim.x) + split
            if tid == 0:
                counters[NC + 2 * lin] = T0
                counters[NC + 2 * lin + 1] = T3
                counters[NC + 2 * int32(cuda.gridDim.x * NC) + 8 * NC + lin] = TF
''')
sub('''                cuda.threadfence()                                                    # (f)
''', '''                T4 = gtimer()
                cuda.threadfence()                                                    # (f)
                T5 = gtimer()
''')
sub('''                              h_kv * G + row - i * G, i, cuda.gridDim.x, scratch, tid)
''', '''                              h_kv * G + row - i * G, i, cuda.gridDim.x, scratch, tid)
                T6 = gtimer()
                if tid == 0:
                    base = NC + 2 * int32(cuda.gridDim.x * NC) + (b * int32(cuda.gridDim.z) + h_kv) * 8
                    counters[base] = T0
                    counters[base + 1] = T1
                    counters[base + 2] = T2
                    counters[base + 3] = T3
                    counters[base + 4] = T4
                    counters[base + 5] = T5
                    counters[base + 6] = T6
                    counters[base + 7] = split
''')
sub('''        key_w = warp * KPW                     # the warp's first key in a tile
''', '''        key_w = warp * KPW                     # the warp's first key in a tile
        TF = T0
''')

decoding = types.ModuleType("decoding_stamped")
decoding.__file__ = "variants/decoding.py (stamped)"
exec(compile(s, decoding.__file__, "exec"), decoding.__dict__)
H, HKV, D, PS, B = 32, 8, 128, 256, 1
# the counter array, laid out as [tickets (B H_kv) | each block's start and stored stamps |
# each group's last block's 8 words | each block's first-tile stamp]: room for it
decoding.split_counters("torch", torch.empty(1, device="cuda"), 1 << 16)
arr = decoding._COUNTERS[("torch", 0)][1]
for L in [int(x) for x in sys.argv[1].split(",")]:
    kc = torch.randn(B * L // PS, PS, HKV, D, device="cuda", dtype=torch.bfloat16); vc = torch.randn_like(kc)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(B * L // PS, device="cuda").to(torch.int32).reshape(B, -1).contiguous()
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    for S in [int(x) for x in sys.argv[2].split(",")]:
        for rep in range(4):
            decoding.decode(q, kc, vc, lens, block_table=table, check=False, num_splits=S, combine="fused")
        torch.cuda.synchronize()
        c = arr.copy_to_host().astype(np.int64)
        NC = B * HKV
        nb = NC * S
        se = c[NC:NC + 2 * nb].reshape(nb, 2)
        t0 = se[:, 0].min()
        rel = lambda x: ((x - t0) % (1 << 32)) / 1000.0
        ends = rel(se[:, 1])
        starts = rel(se[:, 0])
        last = c[NC + 2 * nb: NC + 2 * nb + 8 * NC].reshape(NC, 8)
        tf = rel(c[NC + 2 * nb + 8 * NC: NC + 3 * nb + 8 * NC])
        print(f"L={L} S={S} : block starts {starts.min():.2f}-{starts.max():.2f} us, "
              f"step-2 ends (after fence b) median {np.median(ends):.2f} max {ends.max():.2f} us")
        print(f"   first tile landed (after its wait): min {tf.min():.2f} median {np.median(tf):.2f} max {tf.max():.2f} us")
        for g in range(NC):
            t = [rel(x) for x in last[g, :7]]
            print(f"   group {g} last split {last[g, 7]:3d}: start {t[0]:6.2f} loop-end {t[1]:6.2f} stored {t[2]:6.2f} "
                  f"fenced {t[3]:6.2f} ticket {t[4]:6.2f} fence-f {t[5]:6.2f} merged {t[6]:6.2f}")
