"""FlashAttention-2 forward in Triton: `(o, lse)` for a block of queries against a block of keys.

FA2 loop order: one program per (query block, batch·head); it streams key/value blocks through
on-chip memory keeping the online-softmax state in the paper's notation:
`m_i` running row max, `l_i` running row sum of exp, `acc` unnormalised output, all float32.
Scores are scaled by `softmax_scale·log2(e)` once so the inner loop uses `exp2`; the LSE is
converted back to natural log on the way out.

Causal attention is split into two stages so that only the blocks that straddle the diagonal
(or the ragged end of the key sequence) pay for a mask: stage 1 runs the fully visible blocks
without one, stage 2 the rest with it.

Masks beyond causal (`visibility=`, kernels/masks.py): packed documents, sliding windows, a ring
step's rows at arbitrary global positions. Query row i sees key rows [kv_lo[i], kv_hi[i]); the
program takes the min/max of its rows' intervals and runs three stages over the key blocks in
range: masked blocks where the intervals start, unmasked blocks every row sees whole, masked
blocks where they end. Key blocks outside every row's interval are never visited.

Fused merge (`acc=`): instead of writing a fresh `(o, lse)`, the epilogue reads the caller's
running float32 accumulator `(o_acc, lse_acc)` and writes the exact merge of it with this block's
result back into it (or o to `out=`, e.g. rounded to bf16 at a ring's last step), so a ring
step costs one kernel and no extra pass over O. The math is the one of
`kernels.reference.ref_merge` (weights as sigmoids of the LSE difference).

On Hopper the kernel loads Q, K and V through tensor descriptors (TMA: one instruction per tile
instead of per-thread address arithmetic; `kernels.launch_utils.tma_ok` says when), else through
pointers; the results are the same, and the freed registers and issue slots make it faster.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ringflash.kernels.checks import check_qkv, resolve_fwd_outputs, resolve_scale
from ringflash.kernels.launch_utils import (
    LOG2E,
    bhnd_strides,
    block_d,
    dot_precision,
    kernel_inputs,
    num_sms,
    upcast_dots,
)
from ringflash.kernels.masks import Visibility, batch_stride
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
from ringflash.kernels.tuning import Tile, launch


@triton.jit
def tanh(x):
    """tanh from one exp2 of a non-positive argument: no overflow, exact to float32 rounding."""
    e = tl.math.exp2(-2.8853900817779268 * tl.abs(x))  # e^(-2|x|); 2/ln 2
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


def score_args(scale: float, softcap: float) -> tuple[float, float]:
    """`(qk_scale, cap)` kernel arguments: scores in exp2 units are `qk·qk_scale`, or with a softcap c
    `cap·tanh(qk·qk_scale)` = log2(e)·c·tanh(qk·scale/c) (`AttnSpec.softcap`)."""
    if not softcap:
        return scale * LOG2E, 1.0
    return scale / softcap, softcap * LOG2E


class Settings(NamedTuple):
    """A kernel's compile-time settings (its constexpr arguments of the same names), handed to the
    functions it calls as the one constexpr `CFG`. They read each by name, `CFG.BLOCK_N`: Triton keeps
    a NamedTuple's fields constexpr, where unpacking a plain tuple would make tensors of them, and no
    list of settings has to be kept in the same order in two places."""

    CAUSAL: bool
    RANGES: bool
    UPCAST: bool
    PRECISION: str
    SOFTCAP: bool
    TMA: bool
    HEAD_DIM: int
    HEAD_DIM_V: int
    GROUP: int
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_D: int
    BLOCK_DV: int


@triton.jit
def pair_rows(pair, start, offs_d, offs_dv, CHECK_ROWS: tl.constexpr, ROWS: tl.constexpr, CFG: tl.constexpr):
    """Rows `[start, start + ROWS)` of a head pair that the inner loops walk together: K and V, or Q
    and dO. `pair = (a_src, b_src, stride_a, stride_b, off_b, off_h, n_rows)` (the kernels' `kv` and
    `qdo` groups); the first has `CFG.HEAD_DIM` columns, the second `CFG.HEAD_DIM_V`, both upcast
    where `CFG.UPCAST`. Rows past n_rows read as zeros (`head_rows`, CHECK_ROWS)."""
    a_src, b_src, stride_a, stride_b, off_b, off_h, n_rows = pair
    a = head_rows(a_src, stride_a, off_b, start, off_h * CFG.HEAD_DIM, offs_d, n_rows, CHECK_ROWS, CFG.TMA,
                  ROWS, CFG.HEAD_DIM, CFG.BLOCK_D)
    b = head_rows(b_src, stride_b, off_b, start, off_h * CFG.HEAD_DIM_V, offs_dv, n_rows, CHECK_ROWS, CFG.TMA,
                  ROWS, CFG.HEAD_DIM_V, CFG.BLOCK_DV)
    if CFG.UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, kv, rows, score, lo, hi, MASKED: tl.constexpr, CFG: tl.constexpr):
    """Fold key/value blocks [lo, hi) into the online-softmax state (acc, l_i, m_i).

    The kernel's calls differ only in [lo, hi) and MASKED; what they share comes in groups, built
    once by the kernel (as FA3's Params structs): `kv = (k_src, v_src, stride_kn, stride_vn, off_b,
    off_hkv, Nk)`, the kv head's `head_base`s and row strides; `rows = (offs_m, kv_lo, kv_hi)`,
    the query rows and the key interval each sees (RANGES); `score = (qk_scale, cap)`
    (`score_args`); `CFG`, the kernel's `Settings` (BLOCK_N is the step).

    MASKED blocks hide keys past Nk and, by the causal diagonal or the rows' intervals
    [kv_lo, kv_hi) (RANGES; they lie within [0, Nk)), the keys a row does not see."""
    Nk = kv[6]
    offs_m, kv_lo, kv_hi = rows
    qk_scale, cap = score
    offs_n = tl.arange(0, CFG.BLOCK_N)
    offs_d = tl.arange(0, CFG.BLOCK_D)
    offs_dv = tl.arange(0, CFG.BLOCK_DV)
    for start_n in range(lo, hi, CFG.BLOCK_N):
        cols = start_n + offs_n
        # Keys past Nk read as zeros (only MASKED blocks reach them); the mask hides them.
        k, v = pair_rows(kv, start_n, offs_d, offs_dv, MASKED, CFG.BLOCK_N, CFG)
        qk = tl.dot(q, tl.trans(k), input_precision=CFG.PRECISION) * qk_scale
        if CFG.SOFTCAP:  # before the mask, as flash_attn: masked keys stay at -inf
            qk = cap * tanh(qk)
        if MASKED:
            visible = visible_keys(offs_m, cols, kv_lo, kv_hi, Nk, CFG.CAUSAL, CFG.RANGES)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_shift = m_new
        if MASKED:
            # A row can see no key of this block; while it has seen none at all, m is -inf
            # and exp2(-inf - -inf) would be NaN. Shift such rows by 0 for this block only:
            # m keeps -inf, so the next block's true max becomes the shift. Keeping 0 instead
            # would shift logits far below 0 by 0, and P, cast to fp16/bf16 for P·V,
            # underflows to 0 while l (float32) does not: o = 0 instead of v.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=CFG.PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def merge_weights(lse_acc, lse_blk):
    """The exact merge of two partial results' rows: `(w_acc, w_blk, lse)` such that
    o = o_acc·w_acc + o_blk·w_blk. Elementwise, so any kernel's row layout will do (the Gluon
    forward calls it too).

    lse = logaddexp(lse_acc, lse_blk), w_blk = σ(d), w_acc = σ(−d) with d = lse_blk − lse_acc:
    weights in [0, 1] that are exact to float32 precision however large |lse| is. A side with
    lse = −inf gets weight exactly 0; both sides −inf (d = NaN) keep lse = −inf (o is 0 on both).
    """
    # Both -inf: d would be NaN; any finite d will do since o_acc and o_blk are 0 there. Zeroing
    # the operands (not d) keeps -inf - -inf from being evaluated at all.
    both = (lse_acc == float("-inf")) & (lse_blk == float("-inf"))
    d = tl.where(both, 0.0, lse_blk) - tl.where(both, 0.0, lse_acc)
    top = tl.maximum(lse_acc, lse_blk)
    # logaddexp as max + log(1 + e^-|d|); exp(-inf) = 0 covers the one-sided -inf rows.
    lse = tl.where(top == float("-inf"), float("-inf"), top + tl.log(1.0 + tl.exp(-tl.abs(d))))
    return tl.sigmoid(-d), tl.sigmoid(d), lse


@triton.jit
def _merge_into(o_blk, lse_blk, o_ptrs, lse_ptrs, offs_m, offs_d, Nq,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """This block's `(o_blk, lse_blk)` merged with the accumulator at (o_ptrs, lse_ptrs)
    (`merge_weights`)."""
    lse_acc = tl.load(lse_ptrs, mask=offs_m < Nq, other=float("-inf"))
    o_acc = load_tile(o_ptrs, offs_m, offs_d, Nq, True, HEAD_DIM, BLOCK_D).to(tl.float32)
    w_acc, w_blk, lse = merge_weights(lse_acc, lse_blk)
    return o_acc * w_acc[:, None] + o_blk * w_blk[:, None], lse


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, OA,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_on, stride_oh,
    stride_oab, stride_oan, stride_oah,
    stride_lb, stride_lh, stride_ln,
    KV_LO, KV_HI, stride_rb,
    H, Nq, Nk, qk_scale, cap, n_sms,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr,
    RANGES: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, MERGE: tl.constexpr, TMA: tl.constexpr,
    SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # Last query blocks first: under a causal mask they see the most keys.
    rank, off_bh = heaviest_first(n_sms)
    start_m = tl.num_programs(0) - 1 - rank
    off_b = off_bh // H
    off_h = off_bh % H
    off_hkv = off_h // GROUP  # GQA: query heads share key/value heads, nothing is repeated

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)  # q and k's head dim
    offs_dv = tl.arange(0, BLOCK_DV)  # v and o's

    q = head_rows(head_base(Q, off_b, off_h, stride_qb, stride_qh, TMA), stride_qn, off_b, start_m * BLOCK_M,
                  off_h * HEAD_DIM, offs_d, Nq, True, TMA, BLOCK_M, HEAD_DIM, BLOCK_D)
    k_src = head_base(K, off_b, off_hkv, stride_kb, stride_kh, TMA)
    v_src = head_base(V, off_b, off_hkv, stride_vb, stride_vh, TMA)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # What every stage shares, grouped once (`_fwd_inner`).
    kv = (k_src, v_src, stride_kn, stride_vn, off_b, off_hkv, Nk)
    score = (qk_scale, cap)
    CFG: tl.constexpr = Settings(
        CAUSAL=CAUSAL, RANGES=RANGES, UPCAST=UPCAST, PRECISION=PRECISION, SOFTCAP=SOFTCAP, TMA=TMA,
        HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, GROUP=GROUP,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
    )
    if RANGES:
        # Masked blocks where the rows' intervals begin, unmasked ones all rows see, masked ones
        # where the intervals end; nothing outside them (kernels/masks.py).
        row_ok = offs_m < Nq
        kv_lo = tl.load(KV_LO + off_b * stride_rb + offs_m, mask=row_ok, other=0)
        kv_hi = tl.load(KV_HI + off_b * stride_rb + offs_m, mask=row_ok, other=0)
        kv_lo = tl.maximum(kv_lo, 0)
        kv_hi = tl.minimum(kv_hi, Nk)
        lo, split, split2, hi = block_bounds(kv_lo, kv_hi, row_ok, Nk, BLOCK_N)
        rows = (offs_m, kv_lo, kv_hi)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv, rows, score, split, split2, False, CFG)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv, rows, score, lo, split, True, CFG)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv, rows, score, split2, hi, True, CFG)
    else:
        if CAUSAL:
            # Keys before this query block are visible to all of it; the block on the diagonal is
            # not. BLOCK_M is a multiple of BLOCK_N, so the split falls on a key-block boundary.
            split = start_m * BLOCK_M
            hi = tl.minimum(split + BLOCK_M, Nk)
        else:
            split = (Nk // BLOCK_N) * BLOCK_N  # full key blocks, then a ragged tail
            hi = Nk
        rows = (offs_m, offs_m, offs_m)  # no intervals: never read
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv, rows, score, 0, split, False, CFG)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv, rows, score, split, hi, True, CFG)

    # Rows that saw no key (l_i == 0) get o = 0 and lse = -inf rather than 0/0.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)  # ln 2

    lse_ptrs = LSE + off_b * stride_lb + off_h * stride_lh + offs_m * stride_ln
    if MERGE:  # OA, LSE hold the running accumulator: merge into it; o goes to O (OA itself, or out=)
        oa_ptrs = tile_ptrs(OA, off_b, off_h, offs_m, offs_dv, stride_oab, stride_oan, stride_oah)
        o, lse = _merge_into(o, lse, oa_ptrs, lse_ptrs, offs_m, offs_dv, Nq, HEAD_DIM_V, BLOCK_DV)
    store_tile(tile_ptrs(O, off_b, off_h, offs_m, offs_dv, stride_ob, stride_on, stride_oh), o.to(O.dtype.element_ty),
               offs_m, offs_dv, Nq, HEAD_DIM_V, BLOCK_DV)
    tl.store(lse_ptrs, lse, mask=offs_m < Nq)


def triton_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttnSpec,
    softmax_scale: float | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    acc: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    tile: Tile | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q (B, Nq, H, D)` over `k (B, Nk, Hkv, D)`, `v (B, Nk, Hkv, Dv)` with the Triton kernel.

    Returns `o (B, Nq, H, Dv)` (new and contiguous in `out_dtype`, default q's; or `out`) and `lse (B, H, Nq)`
    float32, natural log.
    With `acc=(o_acc, lse_acc)` (float32 `(B, Nq, H, Dv)` and `(B, H, Nq)`, any strides with a
    contiguous last dim of o_acc) this block's result is merged into them in place and they are returned
    (o_acc may be in q's dtype where `out=` is given: `kernels.attn_fwd`).
    `out`: where o goes (shaped like o, its own dtype; a view of a larger tensor is fine) instead of
    a new tensor or, with `acc`, o_acc (then only read): the ring's last step rounds its merged o
    to q's dtype this way, without a separate cast.
    `spec`: which keys each query sees (kernels/spec.py).
    """
    check_qkv(q, k, v)
    vis = spec.intervals_for(q, k)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    B, Nq, H, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    o, lse = resolve_fwd_outputs(q, v, out_dtype, acc, out)
    if Nq == 0 or B * H == 0:
        return o, lse
    BD, BDV = block_d(D), block_d(v.shape[3])
    srcs, tile, tma = kernel_inputs("fwd", (q, k, v), tile, max(BD, BDV))
    o_acc = o if acc is None else acc[0]  # never read without acc
    args = (*srcs, o, lse, o_acc, *bhnd_strides(q), *bhnd_strides(k), *bhnd_strides(v), *bhnd_strides(o),
            *bhnd_strides(o_acc),
            *lse.stride(), *_ranges_args(vis, q), H, Nq, Nk, *score_args(scale, spec.softcap), num_sms(q.device))
    consts = dict(HEAD_DIM=D, HEAD_DIM_V=v.shape[3], GROUP=H // Hkv, CAUSAL=spec.causal and vis is None,
                  RANGES=vis is not None, UPCAST=upcast_dots(q.dtype), PRECISION=dot_precision(q.dtype),
                  MERGE=acc is not None, TMA=tma, BLOCK_D=BD, BLOCK_DV=BDV, SOFTCAP=bool(spec.softcap))
    launch("fwd", _attn_fwd_kernel, lambda meta: (triton.cdiv(Nq, meta["BLOCK_M"]), B * H), args, consts, tile)
    return o, lse


def _ranges_args(vis: Visibility | None, q: torch.Tensor) -> tuple:
    """(KV_LO, KV_HI, batch stride) kernel arguments; placeholders, never read, without a Visibility."""
    if vis is None:
        return q, q, 0
    return vis.kv_lo, vis.kv_hi, batch_stride(vis.kv_lo)
