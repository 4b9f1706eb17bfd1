"""The IO model: HBM bytes each algorithm's loop order implies, beside the FA1 paper's bounds.

    python experiments/io_model.py [--seqlen 4096] [--head-dim 64] [--blocks 32,64,128,256]

FA1 paper, Theorem 2: standard attention makes Theta(N d + N^2) HBM accesses, FlashAttention
Theta(N^2 d^2 / M) with SRAM of M elements (B_c = M / 4d). These functions count the bytes
exactly, per (batch, head), for a non-causal square problem, as the algorithms are written
(not as a cache may serve them: an L2 that holds K and V turns FA2's re-reads into hits, which is
what a measured DRAM count shows and this model does not):

standard (Alg. 0, variants/standard.py): read Q, K; write S (fp32); read S; write P (16-bit);
    read P, V; write O. S and P rows padded to 64 keys.
fa1 (Alg. 1, K/V blocks outer): O, l, m initialised in HBM (l.2; O in fp32, as variants/fa1.py
    keeps it); K, V read once (l.6); for each of the T_c = N / B_c K/V blocks, every Q_i, O_i, l_i,
    m_i read (l.8) and O_i, l_i, m_i written (l.12-13). The final cast of O to 16 bits is left out.
fa2 (FA2 Alg. 1, query blocks outer): Q read once, K and V once per query block (T_r = N / B_r
    times), O written once (16-bit) and L once (fp32).
"""
import argparse
import math


def standard_bytes(n, d, elem=2):
    n_pad = math.ceil(n / 64) * 64
    qkvo = 4 * n * d * elem                      # Q, K, V read; O written
    scores = n * n_pad * (4 + 4 + elem + elem)   # S written and read (fp32), P written and read
    return qkvo + scores


def fa1_bytes(n, d, block_n, elem=2):
    t_c = math.ceil(n / block_n)
    init = n * d * 4 + 2 * n * 4                 # l.2: O (fp32), l, m
    kv = 2 * n * d * elem                        # l.6, once per K/V block, each block once
    per_block = n * d * elem + 2 * n * d * 4 + 2 * 2 * n * 4   # l.8 Q, O, l, m; l.12-13 O, l, m
    return init + kv + t_c * per_block


def fa2_bytes(n, d, block_m, elem=2):
    t_r = math.ceil(n / block_m)
    return n * d * elem + t_r * 2 * n * d * elem + n * d * elem + n * 4   # Q; K, V per Q_i; O; L


def theorem2(n, d, sram_bytes, elem=2):
    """The FA1 paper's bounds, in elements: (N d + N^2, N^2 d^2 / M) with M = SRAM elements."""
    m = sram_bytes / elem
    return n * d + n * n, n * n * d * d / m


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--blocks", default="32,64,128,256")
    args = ap.parse_args(argv)
    n, d = args.seqlen, args.head_dim
    std = standard_bytes(n, d)
    print(f"N={n} d={d}, bytes per (batch, head); standard: {std / 1e6:.1f} MB")
    print(f"{'block':>6} {'fa1 (B_c) MB':>13} {'fa2 (B_r) MB':>13} {'std/fa1':>8} {'std/fa2':>8}")
    rows = []
    for blk in (int(x) for x in args.blocks.split(",")):
        f1, f2 = fa1_bytes(n, d, blk), fa2_bytes(n, d, blk)
        rows.append(dict(block=blk, standard=std, fa1=f1, fa2=f2))
        print(f"{blk:>6} {f1 / 1e6:>13.1f} {f2 / 1e6:>13.1f} {std / f1:>8.1f} {std / f2:>8.1f}")
    return rows


if __name__ == "__main__":
    main()
