"""experiments/io_model.py against a hand count: B = H = 1, N = 128, d = 64, 16-bit inputs, blocks
of 64 (two query blocks, two K/V blocks)."""
from experiments import io_model

N, D = 128, 64
TILE = N * D * 2            # one of Q, K, V, O in 16 bits: 16 384 bytes


def test_fa2_reads_q_once_and_kv_once_a_query_block():
    # Q once, K and V for each of the 2 query blocks, O once, L (fp32) once
    assert io_model.fa2_bytes(N, D, 64) == TILE + 2 * 2 * TILE + TILE + N * 4 == 98_816


def test_fa1_round_trips_o_l_m_every_kv_block():
    o32, stats = N * D * 4, N * 4
    init = o32 + 2 * stats                          # l.2: O, l, m
    kv = 2 * TILE                                   # l.6: each K_j, V_j once
    step = TILE + 2 * o32 + 4 * stats               # l.8 Q, O, l, m in; l.12-13 O, l, m out
    assert io_model.fa1_bytes(N, D, 64) == init + kv + 2 * step == 234_496


def test_standard_moves_s_and_p():
    # Q, K, V in, O out; S (fp32) out and in, P (16-bit) out and in, N x N
    assert io_model.standard_bytes(N, D) == 4 * TILE + N * N * (4 + 4 + 2 + 2) == 262_144


def test_bigger_blocks_mean_fewer_bytes_and_the_theorem_s_ratio():
    # FA2's K/V re-reads fall as 1 / B_r; FA1's O round trips as 1 / B_c
    assert io_model.fa2_bytes(4096, 64, 128) < io_model.fa2_bytes(4096, 64, 64)
    assert io_model.fa1_bytes(4096, 64, 128) < io_model.fa1_bytes(4096, 64, 64)
    std, flash = io_model.theorem2(4096, 64, 100 * 1024)
    assert std == 4096 * 64 + 4096 ** 2 and abs(flash - 4096 ** 2 * 64 ** 2 / 51200) < 1e-6
