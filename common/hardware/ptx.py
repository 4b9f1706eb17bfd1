"""The sm_80-style PTX instructions under the name the kernels use: `from common.hardware import ptx`, then
`ptx.mma_bf16_16816(...)`. Each is common/hardware/sm80.py's (the table of names and PTX is there, each GPU
intrinsic beside its simulator stand-in); this module only re-exports them, so that the kernels'
source names one stable module while the hardware layer is laid out by architecture (sm80.py,
sm90.py).
"""
from common.hardware import sm80

mma_bf16_16816 = sm80.mma_bf16_16816
mma_f16_16816 = sm80.mma_f16_16816
ldmatrix_x4 = sm80.ldmatrix_x4
ldmatrix_x4_trans = sm80.ldmatrix_x4_trans
shfl_xor_f32 = sm80.shfl_xor_f32
shfl_xor_u32 = sm80.shfl_xor_u32
broadcast_u32 = sm80.broadcast_u32
syncwarp = sm80.syncwarp
bar_sync = sm80.bar_sync
bar_arrive = sm80.bar_arrive
ex2_approx = sm80.ex2_approx
ex2_poly = sm80.ex2_poly
rcp_approx = sm80.rcp_approx
prmt = sm80.prmt
pack_bf16x2 = sm80.pack_bf16x2
pack_f16x2 = sm80.pack_f16x2
pack_e4m3x4 = sm80.pack_e4m3x4
unpack_bf16x2 = sm80.unpack_bf16x2
unpack_f16x2 = sm80.unpack_f16x2
cp_async_16 = sm80.cp_async_16
global_address = sm80.global_address
cp_async_16_from = sm80.cp_async_16_from
cp_async_commit = sm80.cp_async_commit
cp_async_wait = sm80.cp_async_wait
ld_shared_v4_u32 = sm80.ld_shared_v4_u32
st_global_v4_u32 = sm80.st_global_v4_u32
ld_global_v4_u32 = sm80.ld_global_v4_u32
st_shared_u32 = sm80.st_shared_u32
red_add_v2_f32 = sm80.red_add_v2_f32
red_add_v2_f32_at = sm80.red_add_v2_f32_at
st_shared_v4_f32 = sm80.st_shared_v4_f32
bulk_reduce_add_f32 = sm80.bulk_reduce_add_f32
bulk_store = sm80.bulk_store
bulk_commit = sm80.bulk_commit
bulk_wait_read = sm80.bulk_wait_read
bulk_wait = sm80.bulk_wait
fence_proxy_async_shared = sm80.fence_proxy_async_shared
