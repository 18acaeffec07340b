"""The Hopper forward: Gluon, a loader warp and two or three consumer warpgroups that never wait
for each other (the opt-in `backend="hopper"`; results as the Triton kernel's, to float rounding).

One program per (query block, batch·head), FlashAttention-3's structure in partitions
(`gl.warp_specialize`):
- a one-warp loader brings the block's 64-row parts of Q, then K and V through a 3-slot ring of
  TMA copies on mbarriers;
- consumer warpgroups, each a partition of its own owning 64 query rows, `setmaxnreg` giving them
  the registers the loader does not need (`WARPGROUPS`): at D128 two of them with 240 registers,
  each issuing S = Q·Kᵀ of the next key block before this block's softmax; at D64 three with 160,
  which that overlap would not fit, the other two warpgroups keeping the tensor cores busy instead.
  P·V from registers, asynchronous. Each writes its own rows of O and lse: o in q's dtype by TMA,
  or (a ring's steps) merged into a running float32 accumulator, or as float32 partials, by
  pointer stores.
Each warpgroup releases a slot with its own arrive (the slot's barrier counts one a warpgroup), so
they never meet: Gluon lowers a partition's arrive with a barrier over all of that partition's
warps, and with two warpgroups in one partition that barrier tied them together at every key
block.
Only key blocks from the block's first diagonal on, or the ragged end of the keys, are masked.
Per-row key intervals (`RANGES`: windows, packed documents, a ring step's rows, the all-gather;
kernels/masks.py) bound the key blocks a program loads: the blocks where its rows' intervals begin
and end are masked, those every row sees whole are not, and those outside every row's interval are
never loaded, as FlashAttention-3 splits a tile's key range.
"""

from __future__ import annotations

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

from ringflash.kernels.checks import check_qkv, resolve_fwd_outputs, resolve_scale
from ringflash.kernels.hopper import (
    interval_bounds,
    ranges_args,
    rows_descriptor,
    slot_barriers,
    tanh,
    tma_load,
    tma_store,
    unsupported,
)
from ringflash.kernels.launch_utils import _descriptor_fits, bhnd_strides, num_sms
from ringflash.kernels.spec import AttnSpec
from ringflash.kernels.tiles import heaviest_first
from ringflash.kernels.triton_fwd import merge_weights, score_args

__all__ = ["hopper_attn_fwd", "hopper_fwd_unsupported"]

WG_ROWS, BLOCK_N, STAGES = 64, 128, 3  # 3 slots: with 2 a warpgroup waits for the one the other reads
# By head dim: consumer warpgroups a program, their registers a thread, and whether each overlaps
# the next block's S = Q·Kᵀ with its softmax (at D64 three warpgroups without it fit 160 registers
# and keep the tensor cores busier than two with it, each exponential serving half the work).
WARPGROUPS = {64: (3, 160, False), 128: (2, 240, True)}


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, b, h, kv_col, start_m, kv_start,
            n_blocks, WGS: gl.constexpr, WG_ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            D: gl.constexpr):
    mbarrier.expect(q_bar, WGS * q_desc.block_type.nbytes)
    for i in gl.static_range(WGS):
        tma_load(q_desc, [b, start_m + i * WG_ROWS, h * D], q_bar, q_smem.index(i))
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
        mbarrier.expect(ready.index(slot), 2 * k_desc.block_type.nbytes)
        tma_load(k_desc, [b, kv_start + j * BLOCK_N, kv_col], ready.index(slot), k_smem.index(slot))
        tma_load(v_desc, [b, kv_start + j * BLOCK_N, kv_col], ready.index(slot), v_smem.index(slot))


@gluon.jit
def _softmax(s, m_i, l_i, score, rows, cols, Nk, MASK: gl.constexpr, CAUSAL: gl.constexpr,
             RANGES: gl.constexpr, SOFTCAP: gl.constexpr):
    """One key block's online-softmax update, the math of kernels/triton_fwd.py's `_fwd_inner`, with
    the row max taken before scaling (qk_scale > 0) so that the scale folds into exp2's argument:
    one FFMA an element instead of a multiply and an FFMA (not in the Triton kernel, whose loop
    ptxas then schedules worse). `score = (qk_scale, cap)` (`triton_fwd.score_args`); SOFTCAP: the
    scores are cap·tanh(s·qk_scale), before the mask as flash_attn, with cap folded into exp2's
    argument as the scale is otherwise. `rows`: the rows' indices and, RANGES, their key intervals
    `(rows, kv_lo, kv_hi)` (kernels/masks.py), which replace the causal and ragged-end tests."""
    qk_scale, cap = score
    if SOFTCAP:
        s = tanh(s * qk_scale)
        qk_scale = cap
    if MASK:
        idx, kv_lo, kv_hi = rows
        if RANGES:
            c = gl.expand_dims(cols, 0)
            vis = (c >= gl.expand_dims(kv_lo, 1)) & (c < gl.expand_dims(kv_hi, 1))
        else:
            vis = gl.expand_dims(cols, 0) < Nk
            if CAUSAL:
                vis = vis & (gl.expand_dims(idx, 1) >= gl.expand_dims(cols, 0))
        s = gl.where(vis, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_shift = m_new
    if MASK:  # rows that have seen no key yet: shift by 0 for this block, keep m = -inf (as _fwd_inner)
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(gl.fma(s, qk_scale, -gl.expand_dims(m_shift, 1)))
    alpha = gl.exp2(m_i - m_shift)
    return p, alpha, l_i * alpha + gl.sum(p, 1), m_new


@gluon.jit
def _pv(acc, p, alpha, v_tile, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """acc·alpha + P·V issued asynchronously (acc complete); P stays in registers as wgmma's A."""
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p = gl.convert_layout(p.to(v_tile.dtype), p_layout)
    return warpgroup_mma(p, v_tile, acc, is_async=True)


@gluon.jit
def _step(q, k_smem, v_smem, ready, empty, s, acc, l_i, m_i, j, rows, cols0, Nk, score, s_zero,
          MASK: gl.constexpr, CAUSAL: gl.constexpr, RANGES: gl.constexpr, SOFTCAP: gl.constexpr,
          BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, o_layout: gl.constexpr,
          p_layout: gl.constexpr):
    """Key block j (its S given) folded in, S of block j + 1 computed meanwhile, j's slot released."""
    nxt = j + 1
    mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
    s_next = warpgroup_mma(q, k_smem.index(nxt % STAGES).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                           use_acc=False, is_async=True)
    p, alpha, l_i, m_i = _softmax(s, m_i, l_i, score, rows, j * BLOCK_N + cols0, Nk, MASK, CAUSAL, RANGES, SOFTCAP)
    acc = _pv(acc, p, alpha, v_smem.index(j % STAGES).reshape([BLOCK_N, D]), o_layout, p_layout)
    acc, s = warpgroup_mma_wait(0, deps=(acc, s_next))
    # Done with the slot. Gluon lowers a partition's arrive as a barrier over all its warps plus one
    # thread's arrive: the hopper forward gives each warpgroup a partition and the slot a count of
    # one a warpgroup, so that barrier spans one warpgroup.
    mbarrier.arrive(empty.index(j % STAGES))
    return s, acc, l_i, m_i


@gluon.jit
def _attend(q_smem, k_smem, v_smem, q_bar, ready, empty, first, blocks, ranges, Nq, Nk, score,
            CAUSAL: gl.constexpr, RANGES: gl.constexpr, SOFTCAP: gl.constexpr, ROWS: gl.constexpr,
            BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
            OVERLAP: gl.constexpr = True):
    """Query rows [first, first + ROWS) of `q_smem` against the K/V ring's key blocks: the unnormalised
    `acc`, the rows' `l_i`, `m_i` (log2 domain) and indices, each slot released after use. P·V from
    registers. `blocks = (kv_start, n_blocks, plain_lo, plain_hi)`: the ring's block i holds keys
    from kv_start + i·BLOCK_N, and blocks [plain_lo, plain_hi) (< n_blocks − 1) need no mask; the
    last always takes it. `ranges`: the rows' key-interval pointers (RANGES; kernels/masks.py).
    OVERLAP: S = Q·Kᵀ of the next block is issued before this block's softmax (FA3's in-warpgroup
    overlap); without it each block's S follows the last one's P·V, in fewer registers."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    kv_start, n_blocks, plain_lo, plain_hi = blocks
    idx = first + gl.arange(0, ROWS, layout=row_layout)
    if RANGES:  # rows past Nq see no key
        KV_LO, KV_HI = ranges
        kv_lo = gl.maximum(gl.load(KV_LO + idx, mask=idx < Nq, other=0), 0)
        kv_hi = gl.minimum(gl.load(KV_HI + idx, mask=idx < Nq, other=0), Nk)
        rows = (idx, kv_lo, kv_hi)
    else:
        rows = (idx, idx, idx)  # no intervals: never read
    cols0 = kv_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
    acc = gl.zeros([ROWS, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    q = q_smem.reshape([ROWS, D])
    mbarrier.wait(q_bar, 0)
    if not OVERLAP:  # the other warpgroups keep the tensor cores busy meanwhile
        for j in range(0, n_blocks):
            mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(j % STAGES).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s, ))
            cols = j * BLOCK_N + cols0
            if (j >= plain_lo) & (j < plain_hi):
                p, alpha, l_i, m_i = _softmax(s, m_i, l_i, score, rows, cols, Nk, False, CAUSAL, RANGES, SOFTCAP)
            else:
                p, alpha, l_i, m_i = _softmax(s, m_i, l_i, score, rows, cols, Nk, True, CAUSAL, RANGES, SOFTCAP)
            acc = _pv(acc, p, alpha, v_smem.index(j % STAGES).reshape([BLOCK_N, D]), o_layout, p_layout)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(empty.index(j % STAGES))
    elif n_blocks > 0:  # intervals can leave a program's rows no key at all
        mbarrier.wait(ready.index(0), 0)
        s = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        for j in range(0, plain_lo):  # where the rows' intervals begin (RANGES only)
            s, acc, l_i, m_i = _step(q, k_smem, v_smem, ready, empty, s, acc, l_i, m_i, j, rows, cols0, Nk, score,
                                     s_zero, True, CAUSAL, RANGES, SOFTCAP, BLOCK_N, D, STAGES, o_layout, p_layout)
        for j in range(plain_lo, plain_hi):
            s, acc, l_i, m_i = _step(q, k_smem, v_smem, ready, empty, s, acc, l_i, m_i, j, rows, cols0, Nk, score,
                                     s_zero, False, CAUSAL, RANGES, SOFTCAP, BLOCK_N, D, STAGES, o_layout, p_layout)
        for j in range(plain_hi, n_blocks - 1):  # the masked blocks before the last, if any
            s, acc, l_i, m_i = _step(q, k_smem, v_smem, ready, empty, s, acc, l_i, m_i, j, rows, cols0, Nk, score,
                                     s_zero, True, CAUSAL, RANGES, SOFTCAP, BLOCK_N, D, STAGES, o_layout, p_layout)
        last = n_blocks - 1
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, score, rows, last * BLOCK_N + cols0, Nk, True, CAUSAL,
                                      RANGES, SOFTCAP)
        acc = _pv(acc, p, alpha, v_smem.index(last % STAGES).reshape([BLOCK_N, D]), o_layout, p_layout)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
    return acc, l_i, m_i, idx


@gluon.jit
def _finish(acc, l_i, m_i, rows, q_smem, o_desc, O, OA, LSE, o_strides, oa_strides, lse_strides, b, h, first, Nq,
            TMA_OUT: gl.constexpr, MERGE: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr,
            NUM_WARPS: gl.constexpr):
    """`_attend`'s rows written out, rows past Nq left alone: o = acc / l and lse (-inf where no key
    was seen). MERGE: merged first with the running accumulator (o_acc at OA, lse_acc at LSE) by
    kernels/triton_fwd.py's `merge_weights`. TMA_OUT: o goes by TMA through Q's buffer, free by now,
    else by pointer stores to O in its own dtype (float32 partials, views)."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, D, 16])
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    no_key = l_i == 0.0
    l_safe = gl.where(no_key, 1.0, l_i)
    lse = gl.where(no_key, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    o = acc / gl.expand_dims(gl.convert_layout(l_safe, o_rows), 1)
    lse_ptrs = LSE + b * lse_strides[0] + h * lse_strides[1] + rows * lse_strides[2]
    row_ok = rows < Nq
    if not TMA_OUT:
        rows_o = gl.expand_dims(gl.convert_layout(rows, o_rows), 1)
        cols = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, o_layout)), 0)
        in_range = (rows_o < Nq) & (cols < D)
    if MERGE:
        w_acc, w_blk, lse = merge_weights(gl.load(lse_ptrs, mask=row_ok, other=float("-inf")), lse)
        o_acc = gl.load(OA + b * oa_strides[0] + h * oa_strides[2] + rows_o * oa_strides[1] + cols, mask=in_range,
                        other=0.0)
        o = (o_acc.to(gl.float32) * gl.expand_dims(gl.convert_layout(w_acc, o_rows), 1)
             + o * gl.expand_dims(gl.convert_layout(w_blk, o_rows), 1))
    gl.store(lse_ptrs, lse, mask=row_ok)
    if TMA_OUT:
        q_smem.reshape([ROWS, D]).store(o.to(q_smem.dtype))
        fence_async_shared()
        tma_store(o_desc, [b, first, h * D], q_smem)
        tma.store_wait(pendings=0)
    else:
        gl.store(O + b * o_strides[0] + h * o_strides[2] + rows_o * o_strides[1] + cols, o.to(O.dtype.element_ty),
                 mask=in_range)


@gluon.jit
def _consumer(q_smem, o_desc, out, k_smem, v_smem, q_bar, ready, empty, b, h, first, blocks, ranges, Nq, Nk,
              score, CAUSAL: gl.constexpr, RANGES: gl.constexpr, SOFTCAP: gl.constexpr, TMA_OUT: gl.constexpr,
              MERGE: gl.constexpr, WG_ROWS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
              OVERLAP: gl.constexpr):
    """One warpgroup's partition: its 64 rows attended and written out (`out`: `_finish`'s O, OA, LSE
    and their strides)."""
    acc, l_i, m_i, rows = _attend(q_smem, k_smem, v_smem, q_bar, ready, empty, first, blocks, ranges, Nq, Nk,
                                  score, CAUSAL, RANGES, SOFTCAP, WG_ROWS, BLOCK_N, D, STAGES, 4, OVERLAP)
    O, OA, LSE, o_strides, oa_strides, lse_strides = out
    _finish(acc, l_i, m_i, rows, q_smem, o_desc, O, OA, LSE, o_strides, oa_strides, lse_strides, b, h, first, Nq,
            TMA_OUT, MERGE, WG_ROWS, D, 4)


@gluon.jit
def _hopper_fwd(q_desc, k_desc, v_desc, o_desc, O, OA, LSE, stride_ob, stride_on, stride_oh,
                stride_oab, stride_oan, stride_oah, stride_lb, stride_lh, stride_ln, KV_LO, KV_HI, stride_rb,
                H, GROUP, Nq, Nk, qk_scale, cap, n_sms,
                CAUSAL: gl.constexpr, RANGES: gl.constexpr, SOFTCAP: gl.constexpr, TMA_OUT: gl.constexpr,
                MERGE: gl.constexpr, WGS: gl.constexpr, WG_ROWS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, OVERLAP: gl.constexpr, ROWS_P2: gl.constexpr,
                num_warps: gl.constexpr):
    rank, bh = heaviest_first(n_sms)  # causal: the longest row blocks start first, swept over heads
    pid_m = gl.num_programs(0) - 1 - rank
    b = bh // H
    h = bh % H
    kv_col = (h // GROUP) * D
    start_m = pid_m * WGS * WG_ROWS
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [WGS, 1, WG_ROWS, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    ready, empty = slot_barriers(STAGES, WGS)  # each warpgroup releases a slot once
    ranges = (KV_LO + b * stride_rb, KV_HI + b * stride_rb)
    if RANGES:  # masked where the rows' intervals begin and end, plain where all rows see all keys
        kv_start, u_lo, u_hi, kv_end = interval_bounds(ranges[0], ranges[1], start_m, Nq, Nk, WGS * WG_ROWS, ROWS_P2,
                                                       BLOCK_N, num_warps)
        n_blocks = gl.maximum(gl.cdiv(kv_end - kv_start, BLOCK_N), 0)
        plain_lo = (u_lo - kv_start) // BLOCK_N
        plain_hi = gl.minimum((u_hi - kv_start) // BLOCK_N, n_blocks - 1)
    elif CAUSAL:  # Nq == Nk: keys up to the block's last row; masked from the block's first row on
        kv_start = 0
        n_blocks = gl.cdiv(gl.minimum(start_m + WGS * WG_ROWS, Nk), BLOCK_N)
        plain_lo = 0
        plain_hi = start_m // BLOCK_N
    else:  # the last key block may be ragged
        kv_start = 0
        n_blocks = gl.cdiv(Nk, BLOCK_N)
        plain_lo = 0
        plain_hi = n_blocks - 1
    blocks = (kv_start, n_blocks, plain_lo, plain_hi)
    o_strides = (stride_ob, stride_on, stride_oh)
    oa_strides = (stride_oab, stride_oan, stride_oah)
    lse_strides = (stride_lb, stride_lh, stride_ln)
    out = (O, OA, LSE, o_strides, oa_strides, lse_strides)
    score = (qk_scale, cap)
    # Gluon takes the partitions as a literal list: one per consumer warpgroup count.
    if WGS == 2:
        gl.warp_specialize(
            [(_consumer, (q_smem.index(0), o_desc, out, k_smem, v_smem, q_bar, ready, empty, b, h, start_m,
                          blocks, ranges, Nq, Nk, score, CAUSAL, RANGES, SOFTCAP, TMA_OUT, MERGE, WG_ROWS, BLOCK_N, D,
                          STAGES, OVERLAP)),
             (_consumer, (q_smem.index(1), o_desc, out, k_smem, v_smem, q_bar, ready, empty, b, h,
                          start_m + WG_ROWS, blocks, ranges, Nq, Nk, score, CAUSAL, RANGES, SOFTCAP, TMA_OUT, MERGE,
                          WG_ROWS, BLOCK_N, D, STAGES, OVERLAP)),
             (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, b, h, kv_col, start_m,
                        kv_start, n_blocks, WGS, WG_ROWS, BLOCK_N, STAGES, D))],
            worker_num_warps=[4, 1], worker_num_regs=[CONSUMER_REGS, 24])
    else:
        gl.warp_specialize(
            [(_consumer, (q_smem.index(0), o_desc, out, k_smem, v_smem, q_bar, ready, empty, b, h, start_m,
                          blocks, ranges, Nq, Nk, score, CAUSAL, RANGES, SOFTCAP, TMA_OUT, MERGE, WG_ROWS, BLOCK_N, D,
                          STAGES, OVERLAP)),
             (_consumer, (q_smem.index(1), o_desc, out, k_smem, v_smem, q_bar, ready, empty, b, h,
                          start_m + WG_ROWS, blocks, ranges, Nq, Nk, score, CAUSAL, RANGES, SOFTCAP, TMA_OUT, MERGE,
                          WG_ROWS, BLOCK_N, D, STAGES, OVERLAP)),
             (_consumer, (q_smem.index(2), o_desc, out, k_smem, v_smem, q_bar, ready, empty, b, h,
                          start_m + 2 * WG_ROWS, blocks, ranges, Nq, Nk, score, CAUSAL, RANGES, SOFTCAP, TMA_OUT, MERGE,
                          WG_ROWS, BLOCK_N, D, STAGES, OVERLAP)),
             (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, b, h, kv_col, start_m,
                        kv_start, n_blocks, WGS, WG_ROWS, BLOCK_N, STAGES, D))],
            worker_num_warps=[4, 4, 1], worker_num_regs=[CONSUMER_REGS, CONSUMER_REGS, 24])


def hopper_fwd_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec) -> str | None:
    """None if `hopper_attn_fwd` runs attention of q over k under `spec`, else why not (the caller
    runs the Triton kernel)."""
    return unsupported(q, k, v, spec)


def hopper_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                    softmax_scale: float | None = None, *, out_dtype: torch.dtype | None = None,
                    acc: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`triton_attn_fwd`'s contract (kernels/triton_fwd.py) where `hopper_fwd_unsupported` is None:
    `o` (new and contiguous in `out_dtype`, default q's; or `out`) and `lse (B, H, Nq)` float32, or
    this block merged into `acc=(o_acc, lse_acc)` in place."""
    check_qkv(q, k, v)
    (kv_lo, kv_hi, _, _, stride_rb, _), ranges = ranges_args(spec, q, k)  # checked as the Triton kernel does
    o, lse = resolve_fwd_outputs(q, v, out_dtype, acc, out)
    why = hopper_fwd_unsupported(q, k, v, spec)
    if why is not None:
        raise ValueError(f"hopper forward: {why}")
    scale = resolve_scale(softmax_scale, q.shape[-1])
    B, Nq, H, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    q, k, v = (t if _descriptor_fits(t) else t.contiguous() for t in (q, k, v))
    # A fresh o in q's dtype goes out by TMA; merges, float32 partials and views by pointer stores.
    tma_out = acc is None and o.dtype == q.dtype and _descriptor_fits(o)
    o_acc = o if acc is None else acc[0]  # never read without acc
    wgs, regs, overlap = WARPGROUPS[D]
    _hopper_fwd[(triton.cdiv(Nq, wgs * WG_ROWS), B * H)](
        rows_descriptor(q, WG_ROWS), rows_descriptor(k, BLOCK_N), rows_descriptor(v, BLOCK_N),
        rows_descriptor(o if tma_out else q, WG_ROWS), o, o_acc, lse, *bhnd_strides(o), *bhnd_strides(o_acc),
        *lse.stride(), kv_lo, kv_hi, stride_rb, H, H // Hkv, Nq, Nk, *score_args(scale, spec.softcap),
        num_sms(q.device), CAUSAL=spec.causal, RANGES=ranges, SOFTCAP=bool(spec.softcap), TMA_OUT=tma_out,
        MERGE=acc is not None, WGS=wgs, WG_ROWS=WG_ROWS, BLOCK_N=BLOCK_N, D=D, STAGES=STAGES, CONSUMER_REGS=regs,
        OVERLAP=overlap, ROWS_P2=triton.next_power_of_2(wgs * WG_ROWS), num_warps=4,
    )
    return o, lse
