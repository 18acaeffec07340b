"""FlashAttention-2 backward in Triton: `(dq, dk, dv)` from `do`, the inputs, and `(o, lse)`.

Three launches, none with atomics, so gradients are deterministic:
1. `_bwd_preprocess`: `delta = rowsum(do·o)` per query row (float32), from the `o` it is given.
2. `_bwd_dkdv`: one program per (key block, batch·kv-head). Key/value blocks are the outer loop
   (FA2 order); the program streams every query block of every query head that shares this kv
   head (GQA), recomputing `P = exp(S·scale − lse)`, and accumulates dK, dV on chip. Causal under
   wide GQA a program takes key blocks i and n−1−i, so that all are equally long
   (`tuning.pairs_dkdv` says when).
3. `_bwd_dq`: one program per (query block, batch·head) streams key blocks and accumulates dQ.
   Recomputing S and dP once more costs 2 of 7 matmuls; it buys dQ without a race or atomics.
   (kernels/hopper_bwd.py is the opt-in other way: one kernel, dQ added atomically.)

On Hopper both kernels load Q, K, V and dO through tensor descriptors (TMA; see
`kernels.launch_utils.tma_ok` for when), else through pointers; the results are the same.

Masks beyond causal (`visibility=`, kernels/masks.py): both loops visit only the blocks some row
sees, in three stages (masked, unmasked, masked) from the rows' intervals: `_bwd_dq` from the
query rows' key intervals [kv_lo, kv_hi) as the forward does, `_bwd_dkdv` from the key rows'
query intervals [q_lo, q_hi), testing the query rows' [kv_lo, kv_hi) where it masks, so both
kernels apply exactly the forward's mask.

`o` and `lse` need not be the ones this block produced: with the global (ring-merged) ones the
per-block gradients sum to the exact full gradient. A row with `lse = -inf` saw no key anywhere;
it is treated as `+inf` here so that its P is exactly 0 instead of `exp(+inf)`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ringflash.kernels.checks import check_bwd, check_grad_out, check_qkv, resolve_scale
from ringflash.kernels.launch_utils import (
    bhnd_strides,
    block_d,
    dot_precision,
    kernel_inputs,
    num_sms,
    upcast_dots,
)
from ringflash.kernels.masks import batch_stride
from ringflash.kernels.spec import AttnSpec
from ringflash.kernels.tiles import (
    block_bounds,
    head_base,
    head_rows,
    heaviest_first,
    load_tile,
    store_tile,
    tile_ptrs,
    visible_keys,
)
from ringflash.kernels.triton_fwd import Settings, pair_rows, score_args, tanh
from ringflash.kernels.tuning import Tile, launch, pairs_dkdv


@triton.jit
def _bwd_preprocess(
    O, DO, Delta,
    stride_ob, stride_on, stride_oh, stride_dob, stride_don, stride_doh,
    H, Nq,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = load_tile(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :],
                  offs_m, offs_d, Nq, True, HEAD_DIM, BLOCK_D)
    do = load_tile(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_don
                   + offs_d[None, :], offs_m, offs_d, Nq, True, HEAD_DIM, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + off_bh * Nq + offs_m, delta, mask=offs_m < Nq)


@triton.jit
def _load_lse2(LSE, rows, Nq):
    # lse in base 2 for exp2; rows past the end and rows that saw no key get +inf so P = 0.
    lse = tl.load(LSE + rows, mask=rows < Nq, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634  # log2(e)


@triton.jit
def _dkdv_inner(dk, dv, k, v, offs_n, qdo, rows, score, lo, hi, MASKED: tl.constexpr, CFG: tl.constexpr):
    """Accumulate dK, dV of one key block (rows `offs_n`) over query blocks [lo, hi) of one query head.

    Works on transposed scores `S^T (BLOCK_N, BLOCK_M)` so that dV = P^T·dO and dK = dS^T·Q are
    plain products with the key block as rows. As in `_fwd_inner`, the calls differ only in
    [lo, hi) and MASKED; the rest comes in groups: `qdo = (q_src, do_src, stride_qn, stride_don,
    off_b, off_h, Nq)`, the query head's `head_base`s and row strides; `rows = (LSE, Delta, KV_LO,
    KV_HI)`, where its rows' lse, delta and key intervals (RANGES) begin; `score = (qk_scale, cap)`
    (`score_args`); `CFG`, the kernel's `Settings` (BLOCK_M is the step).
    """
    Nq = qdo[6]
    LSE, Delta, KV_LO, KV_HI = rows
    qk_scale, cap = score
    offs_m0 = tl.arange(0, CFG.BLOCK_M)
    offs_d = tl.arange(0, CFG.BLOCK_D)
    offs_dv = tl.arange(0, CFG.BLOCK_DV)
    for start_m in range(lo, hi, CFG.BLOCK_M):
        offs_m = start_m + offs_m0
        # Query rows past Nq load as zeros with lse = +inf, so they contribute exactly nothing.
        q, do = pair_rows(qdo, start_m, offs_d, offs_dv, True, CFG.BLOCK_M, CFG)
        lse2 = _load_lse2(LSE, offs_m, Nq)
        delta = tl.load(Delta + offs_m, mask=offs_m < Nq, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=CFG.PRECISION) * qk_scale
        if CFG.SOFTCAP:
            t_t = tanh(s_t)
            s_t = cap * t_t
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASKED:
            if CFG.RANGES:  # the forward's mask: query row i sees key rows [kv_lo[i], kv_hi[i])
                kv_lo = tl.load(KV_LO + offs_m, mask=offs_m < Nq, other=0)
                kv_hi = tl.load(KV_HI + offs_m, mask=offs_m < Nq, other=0)
                p_t = tl.where((offs_n[:, None] >= kv_lo[None, :]) & (offs_n[:, None] < kv_hi[None, :]), p_t, 0.0)
            elif CFG.CAUSAL:
                p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=CFG.PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=CFG.PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if CFG.SOFTCAP:  # through the cap: d(c·tanh(x/c))/dx = 1 − tanh²
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=CFG.PRECISION)
    return dk, dv


@triton.jit
def _dkdv_block(start_n, off_b, off_hkv, ins, grads, ranges, sizes, score, softmax_scale, CFG: tl.constexpr,
                ACCUMULATE: tl.constexpr):
    """dK, dV of the key block at `start_n` of K/V head `off_hkv`: computed and stored.

    `_bwd_dkdv`'s arguments, grouped by role: `ins = (Q, K, V, DO, LSE, Delta)` and Q, K, V and
    DO's (batch, row, head) strides; `grads = (DK, DV, DKA, DVA)` and their strides; `ranges =
    (KV_LO, KV_HI, Q_LO, Q_HI, stride_rqb, stride_rkb)`; `sizes = (Hkv, Nq, Nk)`; `score =
    (qk_scale, cap)`; `CFG`, the kernel's `Settings`.
    """
    (Q, K, V, DO, LSE, Delta, stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
     stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh) = ins
    (DK, DV, DKA, DVA, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
     stride_dkab, stride_dkan, stride_dkah, stride_dvab, stride_dvan, stride_dvah) = grads
    KV_LO, KV_HI, Q_LO, Q_HI, stride_rqb, stride_rkb = ranges
    Hkv, Nq, Nk = sizes
    offs_n = start_n + tl.arange(0, CFG.BLOCK_N)
    offs_d = tl.arange(0, CFG.BLOCK_D)  # q and k's head dim
    offs_dv = tl.arange(0, CFG.BLOCK_DV)  # v, o and do's

    k = head_rows(head_base(K, off_b, off_hkv, stride_kb, stride_kh, CFG.TMA), stride_kn, off_b, start_n,
                  off_hkv * CFG.HEAD_DIM, offs_d, Nk, True, CFG.TMA, CFG.BLOCK_N, CFG.HEAD_DIM, CFG.BLOCK_D)
    v = head_rows(head_base(V, off_b, off_hkv, stride_vb, stride_vh, CFG.TMA), stride_vn, off_b, start_n,
                  off_hkv * CFG.HEAD_DIM_V, offs_dv, Nk, True, CFG.TMA, CFG.BLOCK_N, CFG.HEAD_DIM_V, CFG.BLOCK_DV)
    if CFG.UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([CFG.BLOCK_N, CFG.BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([CFG.BLOCK_N, CFG.BLOCK_DV], dtype=tl.float32)

    kv_lo_ptr = KV_LO + off_b * stride_rqb
    kv_hi_ptr = KV_HI + off_b * stride_rqb
    if CFG.RANGES:
        # The query blocks some row of which sees this key block (kernels/masks.py), in three
        # stages: unmasked where every query row sees every key row here, masked at either end.
        col_ok = offs_n < Nk
        q_lo = tl.load(Q_LO + off_b * stride_rkb + offs_n, mask=col_ok, other=0)
        q_hi = tl.load(Q_HI + off_b * stride_rkb + offs_n, mask=col_ok, other=0)
        lo, split, split2, hi = block_bounds(q_lo, q_hi, col_ok, Nq, CFG.BLOCK_M)
    else:
        # Causal: query blocks before this key block see none of it; the ones overlapping it
        # (BLOCK_N is a multiple of BLOCK_M) need the mask; every later one sees all of it.
        lo = start_n if CFG.CAUSAL else 0
        split = tl.minimum(start_n + CFG.BLOCK_N, Nq) if CFG.CAUSAL else 0
        split = tl.maximum(lo, split)
        split2 = Nq
        hi = Nq
    for g in range(CFG.GROUP):  # the query heads sharing this kv head, in a fixed order
        off_h = off_hkv * CFG.GROUP + g
        q_base = head_base(Q, off_b, off_h, stride_qb, stride_qh, CFG.TMA)
        do_base = head_base(DO, off_b, off_h, stride_dob, stride_doh, CFG.TMA)
        row_base = (off_b * Hkv * CFG.GROUP + off_h) * Nq
        qdo = (q_base, do_base, stride_qn, stride_don, off_b, off_h, Nq)
        rows = (LSE + row_base, Delta + row_base, kv_lo_ptr, kv_hi_ptr)
        dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, qdo, rows, score, lo, split, True, CFG)
        dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, qdo, rows, score, split, split2, False, CFG)
        if CFG.RANGES:
            dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, qdo, rows, score, split2, hi, True, CFG)

    # ptxas's register allocation for this kernel swings its speed by 10%+ with small changes
    # (float32 stores without the causal mask compile to a slow loop; adding into DK/DV does not):
    # time any change on the ring's variants too (float32, accumulating, non-causal).
    # Each pointer tile is made where it is used, so that no two are live at once.
    dk = dk * softmax_scale
    if ACCUMULATE:  # add the sums in DKA, DVA: DK, DV themselves (accumulate=True) or others (acc=)
        dk += load_tile(tile_ptrs(DKA, off_b, off_hkv, offs_n, offs_d, stride_dkab, stride_dkan, stride_dkah),
                        offs_n, offs_d, Nk, True, CFG.HEAD_DIM, CFG.BLOCK_D).to(tl.float32)
        dv += load_tile(tile_ptrs(DVA, off_b, off_hkv, offs_n, offs_dv, stride_dvab, stride_dvan, stride_dvah),
                        offs_n, offs_dv, Nk, True, CFG.HEAD_DIM_V, CFG.BLOCK_DV).to(tl.float32)
    store_tile(tile_ptrs(DK, off_b, off_hkv, offs_n, offs_d, stride_dkb, stride_dkn, stride_dkh),
               dk.to(DK.dtype.element_ty), offs_n, offs_d, Nk, CFG.HEAD_DIM, CFG.BLOCK_D)
    store_tile(tile_ptrs(DV, off_b, off_hkv, offs_n, offs_dv, stride_dvb, stride_dvn, stride_dvh),
               dv.to(DV.dtype.element_ty), offs_n, offs_dv, Nk, CFG.HEAD_DIM_V, CFG.BLOCK_DV)


@triton.jit
def _bwd_dkdv(
    Q, K, V, DO, LSE, Delta, DK, DV, DKA, DVA,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
    stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
    stride_dkab, stride_dkan, stride_dkah, stride_dvab, stride_dvan, stride_dvah,
    KV_LO, KV_HI, Q_LO, Q_HI, stride_rqb, stride_rkb,
    Hkv, Nq, Nk, qk_scale, cap, softmax_scale, n_sms,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr,
    RANGES: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, TMA: tl.constexpr,
    PAIRED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # PAIRED (causal): program i takes key blocks i and n-1-i, which together see n+1 query
    # blocks' worth of rows: every program is equally long and the grid ends without a tail.
    # (Each block's gradients are computed as unpaired, so they are bit-identical.)
    rank, off_bh = heaviest_first(n_sms)
    off_b = off_bh // Hkv
    off_hkv = off_bh % Hkv
    n_blocks = tl.cdiv(Nk, BLOCK_N)
    n_halves: tl.constexpr = 2 if PAIRED else 1

    # The arguments by role (`_dkdv_block`).
    ins = (Q, K, V, DO, LSE, Delta, stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
           stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh)
    grads = (DK, DV, DKA, DVA, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
             stride_dkab, stride_dkan, stride_dkah, stride_dvab, stride_dvan, stride_dvah)
    ranges = (KV_LO, KV_HI, Q_LO, Q_HI, stride_rqb, stride_rkb)
    sizes = (Hkv, Nq, Nk)
    score = (qk_scale, cap)
    CFG: tl.constexpr = Settings(
        CAUSAL=CAUSAL, RANGES=RANGES, UPCAST=UPCAST, PRECISION=PRECISION, SOFTCAP=SOFTCAP, TMA=TMA,
        HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, GROUP=GROUP,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
    )
    for half in tl.static_range(n_halves):
        block = rank if half == 0 else n_blocks - 1 - rank  # first key blocks first: every query sees them
        if block >= rank + half:  # the second half of the middle program of an odd count: done already
            _dkdv_block(block * BLOCK_N, off_b, off_hkv, ins, grads, ranges, sizes, score, softmax_scale, CFG,
                        ACCUMULATE)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, kv, rows, score, lo, hi, MASKED: tl.constexpr, CFG: tl.constexpr):
    """Accumulate dQ of one query block over key blocks [lo, hi).

    Its arguments are `_fwd_inner`'s groups: `kv = (k_src, v_src, stride_kn, stride_vn, off_b,
    off_hkv, Nk)`, `rows = (offs_m, kv_lo, kv_hi)`, `score = (qk_scale, cap)` and `CFG`, the kernel's
    `Settings`."""
    Nk = kv[6]
    offs_m, kv_lo, kv_hi = rows
    qk_scale, cap = score
    offs_n0 = tl.arange(0, CFG.BLOCK_N)
    offs_d = tl.arange(0, CFG.BLOCK_D)
    offs_dv = tl.arange(0, CFG.BLOCK_DV)
    for start_n in range(lo, hi, CFG.BLOCK_N):
        cols = start_n + offs_n0
        # Keys past Nk read as zeros (only MASKED blocks reach them); the mask hides them.
        k, v = pair_rows(kv, start_n, offs_d, offs_dv, MASKED, CFG.BLOCK_N, CFG)
        sc = tl.dot(q, tl.trans(k), input_precision=CFG.PRECISION) * qk_scale
        if CFG.SOFTCAP:
            t = tanh(sc)
            sc = cap * t
        p = tl.math.exp2(sc - lse2[:, None])
        if MASKED:
            visible = visible_keys(offs_m, cols, kv_lo, kv_hi, Nk, CFG.CAUSAL, CFG.RANGES)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=CFG.PRECISION)
        ds = p * (dp - delta[:, None])
        if CFG.SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=CFG.PRECISION)
    return dq


@triton.jit
def _bwd_dq(
    Q, K, V, DO, LSE, Delta, DQ, DQA,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
    stride_dqb, stride_dqn, stride_dqh, stride_dqab, stride_dqan, stride_dqah,
    KV_LO, KV_HI, stride_rqb,
    H, Nq, Nk, qk_scale, cap, softmax_scale, n_sms,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr,
    RANGES: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    rank, off_bh = heaviest_first(n_sms)
    start_m = (tl.num_programs(0) - 1 - rank) * BLOCK_M  # last query blocks first: they see the most keys
    off_b = off_bh // H
    off_h = off_bh % H
    off_hkv = off_h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)  # q and k's head dim
    offs_dv = tl.arange(0, BLOCK_DV)  # v and do's

    q = head_rows(head_base(Q, off_b, off_h, stride_qb, stride_qh, TMA), stride_qn, off_b, start_m, off_h * HEAD_DIM,
                  offs_d, Nq, True, TMA, BLOCK_M, HEAD_DIM, BLOCK_D)
    do = head_rows(head_base(DO, off_b, off_h, stride_dob, stride_doh, TMA), stride_don, off_b, start_m,
                   off_h * HEAD_DIM_V, offs_dv, Nq, True, TMA, BLOCK_M, HEAD_DIM_V, BLOCK_DV)
    k_base = head_base(K, off_b, off_hkv, stride_kb, stride_kh, TMA)
    v_base = head_base(V, off_b, off_hkv, stride_vb, stride_vh, TMA)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = _load_lse2(LSE + off_bh * Nq, offs_m, Nq)
    delta = tl.load(Delta + off_bh * Nq + offs_m, mask=offs_m < Nq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # What every stage shares, grouped once (`_dq_inner`, as the forward's `_fwd_inner`).
    kv = (k_base, v_base, stride_kn, stride_vn, off_b, off_hkv, Nk)
    score = (qk_scale, cap)
    CFG: tl.constexpr = Settings(
        CAUSAL=CAUSAL, RANGES=RANGES, UPCAST=UPCAST, PRECISION=PRECISION, SOFTCAP=SOFTCAP, TMA=TMA,
        HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, GROUP=GROUP,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
    )
    if RANGES:  # as the forward: masked, unmasked, masked key blocks from the rows' intervals
        row_ok = offs_m < Nq
        kv_lo = tl.maximum(tl.load(KV_LO + off_b * stride_rqb + offs_m, mask=row_ok, other=0), 0)
        kv_hi = tl.minimum(tl.load(KV_HI + off_b * stride_rqb + offs_m, mask=row_ok, other=0), Nk)
        lo, split, split2, hi = block_bounds(kv_lo, kv_hi, row_ok, Nk, BLOCK_N)
        rows = (offs_m, kv_lo, kv_hi)
        dq = _dq_inner(dq, q, do, lse2, delta, kv, rows, score, split, split2, False, CFG)
        dq = _dq_inner(dq, q, do, lse2, delta, kv, rows, score, lo, split, True, CFG)
        dq = _dq_inner(dq, q, do, lse2, delta, kv, rows, score, split2, hi, True, CFG)
    else:
        if CAUSAL:
            split = start_m  # BLOCK_M is a multiple of BLOCK_N: keys before the block are all visible
            hi = tl.minimum(start_m + BLOCK_M, Nk)
        else:
            split = (Nk // BLOCK_N) * BLOCK_N
            hi = Nk
        rows = (offs_m, offs_m, offs_m)  # no intervals: never read
        dq = _dq_inner(dq, q, do, lse2, delta, kv, rows, score, 0, split, False, CFG)
        dq = _dq_inner(dq, q, do, lse2, delta, kv, rows, score, split, hi, True, CFG)

    dq = dq * softmax_scale
    if ACCUMULATE:  # add the sums in DQA: DQ itself (accumulate=True) or another (acc=)
        dq += load_tile(tile_ptrs(DQA, off_b, off_h, offs_m, offs_d, stride_dqab, stride_dqan, stride_dqah),
                        offs_m, offs_d, Nq, True, HEAD_DIM, BLOCK_D).to(tl.float32)
    store_tile(tile_ptrs(DQ, off_b, off_h, offs_m, offs_d, stride_dqb, stride_dqn, stride_dqh),
               dq.to(DQ.dtype.element_ty), offs_m, offs_d, Nq, HEAD_DIM, BLOCK_D)


def _copy_or_zero(t: torch.Tensor, src: torch.Tensor | None) -> None:
    """`t` = `src` (a gradient nothing was added to), or zeros without one."""
    if src is None:
        t.zero_()
    elif src is not t:
        t.copy_(src)


def row_deltas(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """`rowsum(do·o)` per query row, `(B, H, Nq)` float32: the backward's D_i."""
    B, Nq, H, D = o.shape  # D: v's head dim
    delta = torch.empty((B, H, Nq), dtype=torch.float32, device=o.device)
    _bwd_preprocess[(triton.cdiv(Nq, 64), B * H)](
        o, do, delta, *bhnd_strides(o), *bhnd_strides(do), H, Nq, HEAD_DIM=D, BLOCK_M=64, BLOCK_D=block_d(D),
    )
    return delta


def triton_attn_bwd(
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
    after_dkdv: Callable[[], None] | None = None,
    tiles: dict[str, Tile] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention with the Triton kernels.

    `q (B, Nq, H, D)`; `k (B, Nk, Hkv, D)`; `v (B, Nk, Hkv, Dv)`; `do, o (B, Nq, H, Dv)`; `lse (B, H, Nq)`
    float32 natural log. Returns `dq`, `dk`, `dv` shaped like q, k, v in `grad_dtype` (default q's dtype; the
    ring asks for float32 to accumulate across steps): new tensors, or `out`'s (any strides), added
    to what they hold instead of written when `accumulate`, or to what `acc` holds (see
    `kernels.attn_bwd`).
    `spec`: the forward's (kernels/spec.py). `after_dkdv()`: called between the dK/dV launch and
    the dQ launch (see `Backend.bwd_step`).
    """
    check_qkv(q, k, v)
    vis = spec.intervals_for(q, k)
    check_bwd(do, q, v, o, lse)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    out_dtype = grad_dtype or q.dtype
    check_grad_out(out, accumulate, q, k, v, out_dtype, acc)
    B, Nq, H, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    if out is None:
        out = tuple(torch.empty(t.shape, dtype=out_dtype, device=q.device) for t in (q, k, v))
    dq, dk, dv = out
    sums = out if accumulate else acc  # what the gradients are added to (None: nothing)
    if Nq == 0 or Nk == 0 or B * H == 0:  # no (query, key) pair: zero gradients, or the sums unchanged
        dqa, dka, dva = sums or (None, None, None)
        for t, a in ((dk, dka), (dv, dva)):
            _copy_or_zero(t, a)
        if after_dkdv is not None:
            after_dkdv()
        _copy_or_zero(dq, dqa)
        return dq, dk, dv
    lse = lse.contiguous()
    delta = row_deltas(o, do)
    BD, BDV = block_d(D), block_d(v.shape[3])
    common = dict(
        HEAD_DIM=D, HEAD_DIM_V=v.shape[3], GROUP=H // Hkv, CAUSAL=spec.causal and vis is None, RANGES=vis is not None,
        UPCAST=upcast_dots(q.dtype), PRECISION=dot_precision(q.dtype), BLOCK_D=BD, BLOCK_DV=BDV,
        SOFTCAP=bool(spec.softcap),
    )
    if vis is None:  # placeholders, never read
        kv_ranges, q_ranges = (q, q, 0), (q, q, 0)
    else:
        kv_ranges = (vis.kv_lo, vis.kv_hi, batch_stride(vis.kv_lo))
        q_ranges = (vis.q_lo, vis.q_hi, batch_stride(vis.q_lo))
    strides_in = (*bhnd_strides(q), *bhnd_strides(k), *bhnd_strides(v), *bhnd_strides(do))
    tiles = tiles or {}
    dqa, dka, dva = sums or out  # placeholders, never read, without sums
    srcs, tile, tma = kernel_inputs("dkdv", (q, k, v, do), tiles.get("dkdv"), max(BD, BDV))
    paired = pairs_dkdv(common["CAUSAL"], H // Hkv, max(BD, BDV))
    launch("dkdv", _bwd_dkdv, lambda meta: (triton.cdiv(triton.cdiv(Nk, meta["BLOCK_N"]), 1 + paired), B * Hkv),
           (*srcs, lse, delta, dk, dv, dka, dva, *strides_in, *bhnd_strides(dk), *bhnd_strides(dv),
            *bhnd_strides(dka), *bhnd_strides(dva), *kv_ranges[:2], *q_ranges[:2], kv_ranges[2], q_ranges[2],
            Hkv, Nq, Nk, *score_args(scale, spec.softcap), scale, num_sms(q.device)),
           dict(common, ACCUMULATE=sums is not None, TMA=tma, PAIRED=paired), tile)
    if after_dkdv is not None:
        after_dkdv()
    srcs, tile, tma = kernel_inputs("dq", (q, k, v, do), tiles.get("dq"), max(BD, BDV))
    launch("dq", _bwd_dq, lambda meta: (triton.cdiv(Nq, meta["BLOCK_M"]), B * H),
           (*srcs, lse, delta, dq, dqa, *strides_in, *bhnd_strides(dq), *bhnd_strides(dqa), *kv_ranges,
            H, Nq, Nk, *score_args(scale, spec.softcap), scale, num_sms(q.device)),
           dict(common, ACCUMULATE=sums is not None, TMA=tma), tile)
    return dq, dk, dv
