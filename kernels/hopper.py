"""What the Hopper kernels (kernels/hopper_fwd.py, kernels/hopper_bwd.py) share: Gluon's names
across Triton versions, descriptors, their slot rings' barriers, and the cases they run.

Gluon is Triton's explicit dialect: layouts, shared memory, mbarriers, TMA copies, warpgroup
multiplies and warp specialisation are written out instead of chosen by the compiler. It has no
interpreter: the CPU suite compiles these kernels for sm_90 (launch/kernel_report.py, ptxas) and the
`gpu` tests check their results against float64.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ringflash.kernels.launch_utils import _row_strides
from ringflash.kernels.spec import AttnSpec

__all__ = ["HEAD_DIMS", "TensorDescriptor", "interval_bounds", "ranges_args", "rows_descriptor", "slot_barriers",
           "smem_layout", "tanh", "thread_barrier", "tma_load", "tma_reduce_add", "tma_store", "unsupported",
           "unsupported_case"]

HEAD_DIMS = (64, 128)

# Triton 3.6 (the GPU image) names the TMA copies async_copy_* and the barrier thread_barrier; later
# versions async_load / async_store and barrier. 3.6 has the reduce-add only as a builder op
# (async_atomic_add later): the one use of Triton's private API, kept to that version's branch.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # a barrier over the partition's warps
if hasattr(tma, "async_atomic_add"):
    tma_reduce_add = tma.async_atomic_add
else:  # pragma: no cover (Triton 3.6)
    from triton._C.libtriton import ir
    from triton.experimental.gluon.language._core import builtin

    @builtin
    def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)


@gluon.jit
def slot_barriers(STAGES: gl.constexpr, RELEASES: gl.constexpr):
    """The mbarriers of a `STAGES`-slot ring of TMA copies, initialised: `ready` (a slot's copies have
    landed: the loader's one expect-arrive) and `empty` (a slot is free again: `RELEASES` arrives, one
    from each partition that reads it)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=RELEASES)
    return ready, empty


@gluon.jit
def tanh(x):
    """tanh on the MUFU: `tanh.approx.f32`, one instruction where the exact formula (kernels/
    triton_fwd.py's `tanh`) takes an exp2 and a division, as FlashAttention's softcap does. Its
    absolute error, under 2^-10.7, is below a bf16 score's rounding."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def interval_bounds(LO, HI, first, n, n_other, ROWS: gl.constexpr, ROWS_P2: gl.constexpr, BLOCK: gl.constexpr,
                    NUM_WARPS: gl.constexpr):
    """kernels/tiles.py's `block_bounds` for this program's rows `[first, first + ROWS)` of `n`, whose
    intervals over the other side's `n_other` rows are `[LO[i], HI[i])` (kernels/masks.py): `(start,
    u_lo, u_hi, end)`, blocks of the other side in `[start, end)` hold a pair some row sees, those in
    `[u_lo, u_hi)` are seen whole by every row. Reduced over the rows themselves rather than read at
    their ends, so a `Visibility` given by hand needs no monotone bounds. `ROWS_P2`: ROWS rounded up
    to a power of two (an arange's length)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    idx = first + gl.arange(0, ROWS_P2, layout=layout)
    valid = (idx < n) & (idx < first + ROWS)
    lo = gl.maximum(gl.load(LO + idx, mask=valid, other=0), 0)
    hi = gl.minimum(gl.load(HI + idx, mask=valid, other=0), n_other)
    seen = valid & (lo < hi)
    start = gl.min(gl.where(seen, lo, n_other), 0)
    end = gl.max(gl.where(seen, hi, 0), 0)
    # What every row sees; a row that sees nothing empties it.
    all_lo = gl.max(gl.where(valid, gl.where(seen, lo, n_other), 0), 0)
    all_hi = gl.min(gl.where(valid, gl.where(seen, hi, 0), n_other), 0)
    start = start // BLOCK * BLOCK
    u_lo = (all_lo + BLOCK - 1) // BLOCK * BLOCK
    u_hi = all_hi // BLOCK * BLOCK
    if u_hi <= u_lo:
        u_lo = start
        u_hi = start
    return start, u_lo, u_hi, end


def ranges_args(spec: AttnSpec, q: torch.Tensor, k: torch.Tensor) -> tuple:
    """`(KV_LO, KV_HI, Q_LO, Q_HI, batch stride of each pair)`, the interval arguments of the
    Gluon kernels, and whether they are read (RANGES): a window's or the documents' `Visibility`
    (`spec.intervals_for`); for the dense masks placeholders that are never read."""
    from ringflash.kernels.masks import batch_stride

    vis = spec.intervals_for(q, k)
    if vis is None:
        return (q, q, q, q, 0, 0), False
    return (*vis, batch_stride(vis.kv_lo), batch_stride(vis.q_lo)), True


def unsupported_case(dtype: torch.dtype | None, head_dim: int | None, head_dim_v: int | None = None) -> str | None:
    """None if the Hopper kernels run this dtype and head dims on an sm_90 GPU, else why not; what
    is not known yet (a config checked before its tensors exist) may be None."""
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16 or bf16 inputs, got {dtype}"
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"needs a head dim in {HEAD_DIMS}, got {head_dim}"
    if head_dim_v is not None and head_dim is not None and head_dim_v != head_dim:
        return f"needs v.shape[3] == q.shape[3] (one head dim), got {head_dim_v} and {head_dim}"
    return None


def unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec) -> str | None:
    """None if the Hopper kernels run attention of q over k, v under `spec`, else why not."""
    if not q.is_cuda or _capability(q.device) != (9, 0):
        return "needs an sm_90 GPU (H100, H200): wgmma and TMA"
    why = unsupported_case(q.dtype, q.shape[-1], v.shape[-1])
    if why is not None:
        return why
    if spec.causal and q.shape[1] != k.shape[1]:
        return "causal needs as many queries as keys"  # the Triton kernels raise it, naming the shapes
    if q.shape[0] * q.shape[1] * q.shape[2] * k.shape[1] == 0:
        return "no (query, key) pair"
    return None


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def smem_layout(block: list[int], dtype, swizzle: int | None = None) -> gl.NVMMASharedLayout:
    """The shared-memory layout a TMA copy of `block` lands in: swizzled for tiles that feed the
    multiplies (`swizzle` bytes, default the widest the rows allow), plain for 2-D rows of float32
    statistics."""
    if len(block) == 2:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    if swizzle is not None:
        return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=dtype.primitive_bitwidth,
                                    rank=len(block))
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def rows_descriptor(t: torch.Tensor, rows: int, swizzle: int | None = None) -> TensorDescriptor:
    """`t (B, N, H, D)` as a `(B, N, H·D)` descriptor of `rows` positions of one head (zeros past N):
    `kernels.launch_utils.row_descriptor` with the layout Gluon's descriptors carry (`smem_layout`)."""
    B, N, H, D = t.shape
    gdt = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[t.dtype]
    layout = smem_layout([1, rows, D], gdt, swizzle)
    return TensorDescriptor(t, [B, N, H * D], [*_row_strides(t), 1], [1, rows, D], layout)
