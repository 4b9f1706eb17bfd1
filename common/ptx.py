"""The PTX instructions the kernels use, one Python name each.

On a GPU each name is a Numba intrinsic that emits the instruction as inline PTX
(`common/_ptx_gpu.py`). Under NUMBA_ENABLE_CUDASIM=1 the same name is a Python stand-in with the
same per-lane result (`common/_ptx_sim.py`), so every kernel runs unchanged in the simulator.

| name                                 | PTX                                                    |
|--------------------------------------|--------------------------------------------------------|
| mma_bf16_16816, mma_f16_16816        | mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}       |
| ldmatrix_x4, ldmatrix_x4_trans       | ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16       |
| shfl_xor_f32                         | shfl.sync.bfly.b32                                     |
| broadcast_u32                        | shfl.sync.idx.b32 from lane 0: the compiler then knows |
|                                      | the value is warp-uniform (uniform registers)          |
| syncwarp                             | bar.warp.sync                                          |
| bar_sync                             | bar.sync (a named barrier over some of the warps)      |
| bar_arrive                           | bar.arrive (count into a named barrier, do not wait)   |
| ex2_approx                           | ex2.approx.ftz.f32                                     |
| rcp_approx                           | rcp.approx.ftz.f32                                     |
| pack_bf16x2, pack_f16x2              | cvt.rn.{bf16x2,f16x2}.f32                              |
| pack_e4m3x4                          | cvt.rn.satfinite.e4m3x2.f32 (x2): four fp32 -> e4m3    |
| unpack_bf16x2, unpack_f16x2          | mov.b32 {lo, hi}; cvt.f32.{bf16,f16} (both halves)     |
| cp_async_16, cp_async_commit, _wait  | cp.async.cg.shared.global (16 B, zero-fill), groups    |
| global_address, cp_async_16_from     | the same copy from a 64-bit address computed once      |
| ld_shared_v4_u32, st_global_v4_u32   | ld.shared.v4.b32, st.global.v4.b32                     |
| st_shared_u32                        | st.shared.b32                                          |
| red_add_v2_f32                       | red.global.add.v2.f32 (sm_90: two fp32 adds at once)   |
| st_shared_v4_f32                     | st.shared.v4.f32                                       |
| bulk_reduce_add_f32                  | cp.reduce.async.bulk.global.shared::cta...add.f32      |
| bulk_commit, bulk_wait_read, _wait   | cp.async.bulk.commit_group, .wait_group[.read] (sm_90) |
| fence_proxy_async_shared             | fence.proxy.async.shared::cta                          |
"""
from numba import config

if config.ENABLE_CUDASIM:
    from common import _ptx_sim as _impl
else:
    from common import _ptx_gpu as _impl

mma_bf16_16816 = _impl.mma_bf16_16816
mma_f16_16816 = _impl.mma_f16_16816
ldmatrix_x4 = _impl.ldmatrix_x4
ldmatrix_x4_trans = _impl.ldmatrix_x4_trans
shfl_xor_f32 = _impl.shfl_xor_f32
broadcast_u32 = _impl.broadcast_u32
syncwarp = _impl.syncwarp
bar_sync = _impl.bar_sync
bar_arrive = _impl.bar_arrive
ex2_approx = _impl.ex2_approx
rcp_approx = _impl.rcp_approx
pack_bf16x2 = _impl.pack_bf16x2
pack_f16x2 = _impl.pack_f16x2
pack_e4m3x4 = _impl.pack_e4m3x4
unpack_bf16x2 = _impl.unpack_bf16x2
unpack_f16x2 = _impl.unpack_f16x2
cp_async_16 = _impl.cp_async_16
global_address = _impl.global_address
cp_async_16_from = _impl.cp_async_16_from
cp_async_commit = _impl.cp_async_commit
cp_async_wait = _impl.cp_async_wait
ld_shared_v4_u32 = _impl.ld_shared_v4_u32
st_global_v4_u32 = _impl.st_global_v4_u32
st_shared_u32 = _impl.st_shared_u32
red_add_v2_f32 = _impl.red_add_v2_f32
st_shared_v4_f32 = _impl.st_shared_v4_f32
bulk_reduce_add_f32 = _impl.bulk_reduce_add_f32
bulk_commit = _impl.bulk_commit
bulk_wait_read = _impl.bulk_wait_read
bulk_wait = _impl.bulk_wait
fence_proxy_async_shared = _impl.fence_proxy_async_shared
