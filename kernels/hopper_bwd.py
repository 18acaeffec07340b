"""The Hopper backward: one Gluon kernel, dQ added atomically (the opt-in `backend="hopper"`).

The deterministic backward (kernels/triton_bwd.py) runs two kernels and 7 matrix multiplies
where the FLOP convention counts 5: its dQ kernel recomputes S and dP so that no two programs
write the same dQ rows. This one computes everything from one pass over each key block and adds
dQ's partial sums into a float32 buffer with TMA reduce-adds, as FlashAttention-3 does. Float
addition in the order the SMs happen to finish is not associative, so dQ can differ in its last
bits from run to run; dK and dV are written by one program each, so they are reproducible.

One program per (128-key block, batch·kv-head), written in Gluon (Triton's explicit dialect)
because the structure below is what plain Triton does not let a kernel state:
- a one-warp loader partition (`gl.warp_specialize`) brings K and V once, then for each query
  head of the K/V head's group and each query block (`BLOCK_M`) Q, dO and their rows' lse and delta
  through a 2-slot ring of TMA copies on mbarriers; `setmaxnreg` hands its registers to the two
  consumer warpgroups (240 a thread: dK and dV alone hold 128);
- the consumers (64 keys each) issue the multiplies asynchronously and wait only for what the
  next step reads: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ together, dV += Pᵀ·dO beside the dS arithmetic,
  dK += dSᵀ·Q beside dS's copy to shared memory, then dQ = dS·K, scaled and copied to shared
  memory for a TMA reduce-add that runs while the next tile computes;
- only tiles crossing the causal diagonal, an interval's edge or the sequences' ends are masked;
  with per-row key intervals (`RANGES`: windows, documents, a ring step's rows; kernels/masks.py)
  each key block loops over the query tiles that see some of its keys, from its keys' query
  intervals, and skips the rest.
Sequence ends: rows past Nq and keys past Nk read as zeros (TMA) and are masked out of P, so
they contribute nothing and cannot turn into inf or NaN.

Why this structure: dQ added by atomics costs what the two saved multiplies save; the TMA
reduce-adds, their wait deferred to the next tile, are where the gain is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ringflash.kernels.checks import check_bwd, check_grad_out, check_qkv, resolve_scale
from ringflash.kernels.hopper import (
    TensorDescriptor,
    interval_bounds,
    ranges_args,
    rows_descriptor,
    slot_barriers,
    smem_layout,
    tanh,
    thread_barrier,
    tma_load,
    tma_reduce_add,
    unsupported,
)
from ringflash.kernels.launch_utils import _descriptor_fits, bhnd_strides, num_sms
from ringflash.kernels.spec import AttnSpec
from ringflash.kernels.tiles import heaviest_first
from ringflash.kernels.triton_fwd import score_args

__all__ = ["hopper_attn_bwd", "hopper_bwd_unsupported"]

BLOCK_N, STAGES, NUM_WARPS = 128, 2, 8  # a third slot gains nothing at D128 and costs 18% with D64's tiles
# Query rows a tile, by head dim and softcap (D64: 128 is 4-9% faster than 64, but with a softcap
# its Sᵀ tiles and the cap's derivative exceed the registers and spill, where 64 does not).
BLOCK_M = {(64, False): 128, (64, True): 64, (128, False): 64, (128, True): 64}
# dQ's float32 buffer, swizzled in spans of this many bytes, by head dim. A thread's dQ fragment is
# rows of two floats, and 128-byte spans put rows r and r ^ 1 on the same banks: every store conflicts
# two ways. 32-byte spans don't (each TMA reduce-add then moves 8 columns): +2-4% at D64, but -4% at
# D128 for reasons not found.
DQ_SWIZZLE = {64: 32, 128: 128}


@gluon.jit
def _loader(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_ring, do_ring, lse_ring, delta_ring, k_smem,
            v_smem, kv_bar, ready, empty, b, hkv, start_n, q_blocks, H, GROUP,
            BLOCK_M: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma_load(k_desc, [b, start_n, hkv * D], kv_bar, k_smem)
    tma_load(v_desc, [b, start_n, hkv * D], kv_bar, v_smem)
    lo, n_m, _, _ = q_blocks
    for t in range(GROUP * n_m):
        h = hkv * GROUP + t // n_m
        start_m = lo + (t % n_m) * BLOCK_M
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
        mbarrier.expect(ready.index(slot), 2 * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
        tma_load(q_desc, [b, start_m, h * D], ready.index(slot), q_ring.index(slot))
        tma_load(do_desc, [b, start_m, h * D], ready.index(slot), do_ring.index(slot))
        tma_load(lse_desc, [b * H + h, start_m], ready.index(slot), lse_ring.index(slot))
        tma_load(delta_desc, [b * H + h, start_m], ready.index(slot), delta_ring.index(slot))


@gluon.jit
def _consumer(q_ring, do_ring, lse_ring, delta_ring, k_smem, v_smem, ds_smem, dq_smem, dq_desc, kv_bar, ready, empty,
              b, hkv, start_n, q_blocks, ranges, Nq, Nk, GROUP, score, softmax_scale,
              CAUSAL: gl.constexpr, RANGES: gl.constexpr, SOFTCAP: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
    """The key block's dK, dV over the query tiles `q_blocks = (lo, n_m, u_lo, u_hi)` (n_m tiles of
    BLOCK_M rows from lo, for each query head of the group; those in [u_lo, u_hi) see every key of
    the block), dQ's partial sums added as they go. `ranges`: the query rows' key intervals
    (RANGES): as the key rows' query intervals `(Q_LO, Q_HI)` (kernels/masks.py), the same mask by
    their definition, and a key block's are read once where query rows' would be read every tile.
    `score = (qk_scale, cap)` (`triton_fwd.score_args`); SOFTCAP: scores cap·tanh(s·qk_scale), and
    dS through the cap's derivative 1 − tanh²."""
    qk_scale, cap = score
    dtype: gl.constexpr = q_ring.dtype
    # Sᵀ tiles (keys × queries) and dK, dV (keys × D): each warpgroup owns 64 keys
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    # dQ (queries × D): where there are 64 queries a warpgroup (D64's 128-query tiles) the warpgroups
    # split the queries, each multiply D wide; else they split D, each reading all of dS from shared
    # memory: at D64, 32-wide multiplies reading 1.5× the bytes a FLOP, where shared memory binds
    DQ_M_WARPS: gl.constexpr = NUM_WARPS if BLOCK_M >= 16 * NUM_WARPS else 4
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                        warps_per_cta=[DQ_M_WARPS, NUM_WARPS // DQ_M_WARPS],
                                                        instr_shape=[16, D // (NUM_WARPS // DQ_M_WARPS), 16])
    row_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    dk = gl.zeros([BLOCK_N, D], gl.float32, layout=kv_layout)
    dv = gl.zeros([BLOCK_N, D], gl.float32, layout=kv_layout)
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
    dq_zero = gl.zeros([BLOCK_M, D], gl.float32, layout=dq_layout)
    k2 = k_smem.reshape([BLOCK_N, D])
    v2 = v_smem.reshape([BLOCK_N, D])
    lo, n_m, u_lo, u_hi = q_blocks
    if RANGES:  # read once: the block's keys are the program's for its whole loop
        Q_LO, Q_HI = ranges
        q_lo = gl.load(Q_LO + keys, mask=keys < Nk, other=0)
        q_hi = gl.minimum(gl.load(Q_HI + keys, mask=keys < Nk, other=0), Nq)
    mbarrier.wait(kv_bar, 0)
    for t in range(GROUP * n_m):
        h = hkv * GROUP + t // n_m
        start_m = lo + (t % n_m) * BLOCK_M
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        q = q_ring.index(slot).reshape([BLOCK_M, D])
        do = do_ring.index(slot).reshape([BLOCK_M, D])
        s_t = warpgroup_mma(k2, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v2, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        s_t = warpgroup_mma_wait(1, deps=(s_t, ))
        # lse and delta read where they are used: a thread holds a quarter of the tile's columns of each
        lse = lse_ring.index(slot).reshape([BLOCK_M]).load(row_layout)
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634  # no key seen: P = 0
        if SOFTCAP:  # the cap's derivative kept as fp16 (exact to 2^-11 on [0, 1]): a float32 tile more spills
            t_t = tanh(s_t * qk_scale)
            dcap = (1.0 - t_t * t_t).to(gl.float16)
            p_t = gl.exp2(cap * t_t - gl.expand_dims(lse2, 0))
        else:
            p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
        edge = (start_m + BLOCK_M > Nq) | (start_n + BLOCK_N > Nk) | (start_m < u_lo) | (start_m + BLOCK_M > u_hi)
        if CAUSAL:
            edge = edge | (start_m < start_n + BLOCK_N)
        if edge:  # the diagonal's tiles, intervals' edges and the ragged ends; other tiles see all their pairs
            rows = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
            if RANGES:  # key j is seen by query rows [q_lo[j], q_hi[j]): none past Nq, none for keys past Nk
                r = gl.expand_dims(rows, 0)
                vis = (r >= gl.expand_dims(q_lo, 1)) & (r < gl.expand_dims(q_hi, 1))
            else:
                vis = (gl.expand_dims(rows, 0) < Nq) & (gl.expand_dims(keys, 1) < Nk)
                if CAUSAL:
                    vis = vis & (gl.expand_dims(rows, 0) >= gl.expand_dims(keys, 1))
            p_t = gl.where(vis, p_t, 0.0)
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do, dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))
        delta = delta_ring.index(slot).reshape([BLOCK_M]).load(row_layout)
        ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
        if SOFTCAP:  # dS through the cap: d(c·tanh(x/c))/dx = 1 − tanh²
            ds_t = ds_t * dcap.to(gl.float32)
        ds_t = ds_t.to(dtype)
        dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q, dk, is_async=True)
        ds_smem.store(ds_t)
        fence_async_shared()
        thread_barrier()  # dQ's multiply reads both warpgroups' dS
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k2, dq_zero, use_acc=False, is_async=True)
        dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
        tma.store_wait(pendings=0)  # the previous tile's reduce-add has read dq_smem
        # One arrive for the partition, lowered with a barrier over its warps: every warp is done
        # with this slot's Q, dO, with dS, and past the wait above.
        mbarrier.arrive(empty.index(slot))
        dq_smem.reshape([BLOCK_M, D]).store(dq * softmax_scale)
        fence_async_shared()
        thread_barrier()
        tma_reduce_add(dq_desc, [b, start_m, h * D], dq_smem)
    tma.store_wait(pendings=0)
    return dk, dv


@gluon.jit
def _hopper_bwd(q_desc, do_desc, k_desc, v_desc, dq_desc, lse_desc, delta_desc, DK, DV, DKA, DVA,
                stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                stride_dkab, stride_dkan, stride_dkah, stride_dvab, stride_dvan, stride_dvah,
                Q_LO, Q_HI, stride_rkb, H, GROUP, Nq, Nk, qk_scale, cap, softmax_scale, n_sms,
                CAUSAL: gl.constexpr, RANGES: gl.constexpr, SOFTCAP: gl.constexpr, ACCUMULATE: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                num_warps: gl.constexpr):
    # The causal loop's longest key blocks (the first) start first, swept over heads: one K/V head at
    # a time would leave the last head's longest programs to run alone at the end.
    pid_n, bh = heaviest_first(n_sms)
    Hkv = H // GROUP
    b = bh // Hkv
    hkv = bh % Hkv
    start_n = pid_n * BLOCK_N
    ranges = (Q_LO + b * stride_rkb, Q_HI + b * stride_rkb)
    if RANGES:  # the query rows that see some key of the block, from the keys' intervals
        lo, u_lo, u_hi, hi = interval_bounds(ranges[0], ranges[1], start_n, Nk, Nq, BLOCK_N,
                                             BLOCK_N, BLOCK_M, num_warps)
    else:
        lo = start_n if CAUSAL else 0  # causal: queries before the block see none of it (Nq == Nk)
        hi = Nq
        u_lo = 0
        u_hi = Nq
    q_blocks = (lo, gl.maximum(gl.cdiv(hi - lo, BLOCK_M), 0), u_lo, u_hi)
    dtype: gl.constexpr = q_desc.dtype
    q_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, D], q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, D], do_desc.layout)
    lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], lse_desc.layout)
    delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], delta_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D], v_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
    dq_smem = gl.allocate_shared_memory(gl.float32, [1, BLOCK_M, D], dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    ready, empty = slot_barriers(STAGES, 1)  # the consumers are one partition
    dk, dv = gl.warp_specialize(
        [(_consumer, (q_ring, do_ring, lse_ring, delta_ring, k_smem, v_smem, ds_smem, dq_smem, dq_desc, kv_bar,
                      ready, empty, b, hkv, start_n, q_blocks, ranges, Nq, Nk, GROUP, (qk_scale, cap),
                      softmax_scale, CAUSAL, RANGES, SOFTCAP, BLOCK_M, BLOCK_N, D, STAGES, num_warps)),
         (_loader, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_ring, do_ring, lse_ring, delta_ring,
                    k_smem, v_smem, kv_bar, ready, empty, b, hkv, start_n, q_blocks, H, GROUP, BLOCK_M, D, STAGES))],
        worker_num_warps=[1], worker_num_regs=[24])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, D, 16])
    keys = gl.expand_dims(start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout)), 1)
    cols = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout)), 0)
    in_range = keys < Nk
    dk = dk * softmax_scale
    if ACCUMULATE:
        dka = gl.load(DKA + b * stride_dkab + hkv * stride_dkah + keys * stride_dkan + cols, mask=in_range)
        dva = gl.load(DVA + b * stride_dvab + hkv * stride_dvah + keys * stride_dvan + cols, mask=in_range)
        dk += dka.to(gl.float32)
        dv += dva.to(gl.float32)
    gl.store(DK + b * stride_dkb + hkv * stride_dkh + keys * stride_dkn + cols, dk.to(DK.dtype.element_ty),
             mask=in_range)
    gl.store(DV + b * stride_dvb + hkv * stride_dvh + keys * stride_dvn + cols, dv.to(DV.dtype.element_ty),
             mask=in_range)


def hopper_bwd_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec) -> str | None:
    """None if `hopper_attn_bwd` runs this case, else why not (the caller falls back to the
    deterministic kernels)."""
    if torch.are_deterministic_algorithms_enabled():
        return "torch.use_deterministic_algorithms(True) is set: dQ's atomic sums are not reproducible"
    return unsupported(q, k, v, spec)


def _stats(lse: torch.Tensor, delta: torch.Tensor, block_m: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """lse and delta `(B, H, Nq)` as `(B·H, Nq')` descriptors of `block_m` rows, Nq' = Nq rounded up to a
    block: a TMA copy's start must be 16-byte aligned, which row b·h of an odd Nq is not. The padding is
    never used (rows past Nq are masked)."""
    B, H, Nq = lse.shape
    stats = torch.zeros((2, B * H, triton.cdiv(Nq, block_m) * block_m), dtype=torch.float32, device=lse.device)
    stats[0, :, :Nq] = lse.reshape(B * H, Nq)
    stats[1, :, :Nq] = delta.reshape(B * H, Nq)
    layout = smem_layout([1, block_m], gl.float32)
    return tuple(TensorDescriptor(s, list(s.shape), [s.stride(0), 1], [1, block_m], layout) for s in stats)


def hopper_attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    spec: AttnSpec,
    softmax_scale: float | None = None,
    *,
    grad_dtype: torch.dtype | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    accumulate: bool = False,
    acc: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    acc_ready: Callable[[], None] | None = None,
    after_dkdv: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`triton_attn_bwd`'s contract (kernels/triton_bwd.py) where `hopper_bwd_unsupported` is None.

    dQ is summed in float32: in `out`'s dq itself where that is a contiguous float32 tensor (the
    ring's running sums), else in a workspace rounded into it afterwards. `after_dkdv` runs after
    the kernel: dK, dV and dQ are final together, so a ring's dK/dV hop cannot hide behind dQ.
    With `acc_ready` and sums to add, the kernel writes this block's dK/dV in float32 to a
    scratch and `acc_ready()` runs after it, before one pass adds them to the sums: a ring's
    sums then travel while the kernel runs, where adding them in its epilogue would make its
    launch wait for their arrival (`Backend.bwd_step`).
    """
    from ringflash.kernels.triton_bwd import row_deltas

    check_qkv(q, k, v)
    (_, _, q_lo, q_hi, _, stride_rkb), use_ranges = ranges_args(spec, q, k)  # checked as the Triton kernels do
    check_bwd(do, q, v, o, lse)
    why = hopper_bwd_unsupported(q, k, v, spec)
    if why is not None:
        raise ValueError(f"hopper backward: {why}")
    scale = resolve_scale(softmax_scale, q.shape[-1])
    out_dtype = grad_dtype or q.dtype
    check_grad_out(out, accumulate, q, k, v, out_dtype, acc)
    B, Nq, H, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    if out is None:
        out = tuple(torch.empty(t.shape, dtype=out_dtype, device=q.device) for t in (q, k, v))
    dq, dk, dv = out
    sums = out if accumulate else acc
    q, k, v, do = (t if _descriptor_fits(t) else t.contiguous() for t in (q, k, v, do))
    block_m = BLOCK_M[D, bool(spec.softcap)]
    lse_desc, delta_desc = _stats(lse, row_deltas(o, do), block_m)
    in_place = dq.dtype == torch.float32 and dq.is_contiguous() and dq.data_ptr() % 16 == 0
    if in_place:
        dq_sum = dq
        if sums is None:
            dq_sum.zero_()
        elif sums[0] is not dq_sum:
            dq_sum.copy_(sums[0])
    elif sums is None:
        dq_sum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    else:  # a copy: acc is only read, even where it is float32 already
        dq_sum = torch.empty(q.shape, dtype=torch.float32, device=q.device).copy_(sums[0])
    late = acc_ready is not None and sums is not None  # the sums added after the kernel, not in it
    # Where the kernel writes dK, dV: out's, or this block's alone (float32) for the pass after it.
    dk_k, dv_k = (torch.empty(t.shape, dtype=torch.float32, device=q.device) for t in (k, v)) if late else (dk, dv)
    dka, dva = (sums[1], sums[2]) if sums is not None else (dk, dv)  # placeholders, never read, without sums
    _hopper_bwd[(triton.cdiv(Nk, BLOCK_N), B * Hkv)](
        rows_descriptor(q, block_m), rows_descriptor(do, block_m), rows_descriptor(k, BLOCK_N),
        rows_descriptor(v, BLOCK_N), rows_descriptor(dq_sum, block_m, DQ_SWIZZLE[D]),
        lse_desc, delta_desc, dk_k, dv_k, dka, dva,
        *bhnd_strides(dk_k), *bhnd_strides(dv_k), *bhnd_strides(dka), *bhnd_strides(dva),
        q_lo, q_hi, stride_rkb, H, H // Hkv, Nq, Nk, *score_args(scale, spec.softcap), scale, num_sms(q.device),
        CAUSAL=spec.causal, RANGES=use_ranges, SOFTCAP=bool(spec.softcap), ACCUMULATE=sums is not None and not late,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, D=D, STAGES=STAGES, num_warps=NUM_WARPS,
    )
    if acc_ready is not None:
        acc_ready()
    if late:  # summed in float32, rounded once into out (in place where out holds the sums)
        torch.add(sums[1], dk_k, out=dk)
        torch.add(sums[2], dv_k, out=dv)
    if after_dkdv is not None:
        after_dkdv()
    if not in_place:
        dq.copy_(dq_sum)
    return dq, dk, dv
