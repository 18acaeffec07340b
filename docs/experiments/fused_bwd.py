"""Experiment: the backward as one kernel, dQ added atomically, against the two-kernel backward.

    python docs/experiments/fused_bwd.py            # on an H100/H200: gradients, then ms per variant and tile
    python docs/experiments/fused_bwd.py --ptxas    # any machine: registers and spills of each

kernels/triton_bwd.py computes dK/dV and dQ in two kernels, 7 matrix multiplies where FlashAttention's
FLOP convention counts 5, so it can never pass 5/7 of the matmul ceiling in that convention. One
kernel over key blocks can add each query block's dQ share into a float32 workspace instead
(what cuDNN and FlashAttention-3 do; nondeterministic, so it could only be an opt-in). Variants:
  A  dQ = dS·K, pointer atomics
  B  dQ = dS·K, descriptor (TMA) reduce-add
  C  dQᵀ = Kᵀ·dSᵀ (both warpgroups split D instead of the query rows), descriptor reduce-add
  D  as C, pointer atomics
Dense causal or full attention, bf16, power-of-two D, GQA. The outcome is in docs/PERF_NOTES.md
("Backward variants"): every variant spills and none beats the two kernels.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch"))  # benchlib, kernel_report
from benchlib import attn_flops, time_ms
from kernel_report import SM90, ptxas_info

from ringflash.kernels import AttnSpec
from ringflash.kernels.launch_utils import LOG2E, bhnd_strides, num_sms, row_descriptor
from ringflash.kernels.tiles import heaviest_first
from ringflash.kernels.triton_bwd import _bwd_preprocess, _load_lse2, triton_attn_bwd
from ringflash.kernels.triton_fwd import triton_attn_fwd

VARIANTS = "ABCD"
CASES = [("D128 N16k causal", 2, 16384, 16, 16, 128, True), ("D128 N4k causal", 8, 4096, 16, 16, 128, True),
         ("D128 N16k full", 2, 16384, 16, 16, 128, False), ("D64 N16k causal", 2, 16384, 32, 32, 64, True)]
TILES = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2)]  # keys, queries, ...


@triton.jit
def _fused_inner(dk, dv, k, v, Qd, DOd, DQd, DQ, LSE, Delta, off_b, q_col, offs_n, lo, hi, Nq, qk_scale, stride_qn,
                 MASKED: tl.constexpr, VARIANT: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr):
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m0
        q = Qd.load([off_b, start_m, q_col]).reshape(BLOCK_M, D)
        do = DOd.load([off_b, start_m, q_col]).reshape(BLOCK_M, D)
        lse2 = _load_lse2(LSE, rows, Nq)
        delta = tl.load(Delta + rows, mask=rows < Nq, other=0.0)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
        if MASKED:
            p_t = tl.where(rows[None, :] >= offs_n[:, None], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        ds_t = (p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
        dk += tl.dot(ds_t, q)
        if VARIANT == "A" or VARIANT == "B":  # noqa: SIM108 (a constexpr branch per variant)
            dq = tl.dot(tl.trans(ds_t), k)
        else:
            dq = tl.trans(tl.dot(tl.trans(k), ds_t))
        if VARIANT == "B" or VARIANT == "C":
            DQd.atomic_add([off_b, start_m, q_col], dq.reshape(1, BLOCK_M, D))  # rows past Nq are clipped
        else:
            ptrs = DQ + (off_b * Nq + rows[:, None]) * stride_qn + q_col + offs_d[None, :]
            tl.atomic_add(ptrs, dq, mask=rows[:, None] < Nq, sem="relaxed")
    return dk, dv


@triton.jit
def _fused_bwd(Qd, Kd, Vd, DOd, DQd, DQ, LSE, Delta, DK, DV, Hkv, Nq, Nk, qk_scale, softmax_scale, n_sms,
               stride_qn, stride_kn, GROUP: tl.constexpr, CAUSAL: tl.constexpr, VARIANT: tl.constexpr,
               D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    rank, off_bh = heaviest_first(n_sms)
    off_b = off_bh // Hkv
    off_hkv = off_bh % Hkv
    start_n = rank * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kv_col = off_hkv * D
    k = Kd.load([off_b, start_n, kv_col]).reshape(BLOCK_N, D)
    v = Vd.load([off_b, start_n, kv_col]).reshape(BLOCK_N, D)
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    lo = start_n if CAUSAL else 0
    split = tl.maximum(lo, tl.minimum(start_n + BLOCK_N, Nq)) if CAUSAL else 0  # the diagonal's query blocks
    for g in range(GROUP):
        q_col = (off_hkv * GROUP + g) * D
        row_base = (off_b * Hkv * GROUP + off_hkv * GROUP + g) * Nq
        dk, dv = _fused_inner(dk, dv, k, v, Qd, DOd, DQd, DQ, LSE + row_base, Delta + row_base, off_b, q_col, offs_n,
                              lo, split, Nq, qk_scale, stride_qn, True, VARIANT, BLOCK_M, D)
        dk, dv = _fused_inner(dk, dv, k, v, Qd, DOd, DQd, DQ, LSE + row_base, Delta + row_base, off_b, q_col, offs_n,
                              split, Nq, Nq, qk_scale, stride_qn, False, VARIANT, BLOCK_M, D)
    ptrs = (off_b * Nk + offs_n[:, None]) * stride_kn + kv_col + offs_d[None, :]
    tl.store(DK + ptrs, (dk * softmax_scale).to(DK.dtype.element_ty), mask=offs_n[:, None] < Nk)
    tl.store(DV + ptrs, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < Nk)


def fused_attn_bwd(do, q, k, v, o, lse, causal: bool, variant: str = "C", tile=(128, 32, 8, 3)):
    """`(dq, dk, dv)` as `triton_attn_bwd` returns them for dense attention, from one kernel."""
    B, Nq, H, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    scale = D ** -0.5
    block_n, block_m, warps, stages = tile
    delta = torch.empty_like(lse)
    _bwd_preprocess[(triton.cdiv(Nq, 64), B * H)](o, do, delta, *bhnd_strides(o), *bhnd_strides(do), H, Nq,
                                                   HEAD_DIM=D, BLOCK_M=64, BLOCK_D=D)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _fused_bwd[(triton.cdiv(Nk, block_n), B * Hkv)](
        row_descriptor(q, block_m), row_descriptor(k, block_n), row_descriptor(v, block_n), row_descriptor(do, block_m),
        row_descriptor(dq, block_m), dq, lse, delta, dk, dv, Hkv, Nq, Nk, scale * LOG2E, scale, num_sms(q.device),
        H * D, Hkv * D, GROUP=H // Hkv, CAUSAL=causal, VARIANT=variant, D=D, BLOCK_N=block_n, BLOCK_M=block_m,
        num_warps=warps, num_stages=stages)
    return (dq * scale).to(q.dtype), dk, dv


def ptxas(variant: str, tile, head_dim: int = 128, causal: bool = True) -> dict:
    block_n, block_m, warps, stages = tile
    sig = {"Qd": f"tensordesc<bf16[1,{block_m},{head_dim}]>", "Kd": f"tensordesc<bf16[1,{block_n},{head_dim}]>",
           "Vd": f"tensordesc<bf16[1,{block_n},{head_dim}]>", "DOd": f"tensordesc<bf16[1,{block_m},{head_dim}]>",
           "DQd": f"tensordesc<fp32[1,{block_m},{head_dim}]>", "DQ": "*fp32", "LSE": "*fp32", "Delta": "*fp32",
           "DK": "*bf16", "DV": "*bf16", "Hkv": "i32", "Nq": "i32", "Nk": "i32", "qk_scale": "fp32",
           "softmax_scale": "fp32", "n_sms": "i32", "stride_qn": "i32", "stride_kn": "i32"}
    consts = dict(GROUP=1, CAUSAL=causal, VARIANT=variant, D=head_dim, BLOCK_N=block_n, BLOCK_M=block_m)
    sig.update({c: "constexpr" for c in consts})
    sig = {name: sig[name] for name in _fused_bwd.arg_names}
    # what a launch at N = 16k specialises on: every pointer and int but n_sms divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig)
             if (sig[name] == "i32" and name != "n_sms") or sig[name].startswith("*")}
    return ptxas_info(triton.compile(ASTSource(_fused_bwd, sig, consts, attrs), target=SM90,
                                     options={"num_warps": warps, "num_stages": stages}))


def _inputs(B, N, H, Hkv, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(B, N, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    return q, k, v, do


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ptxas", action="store_true", help="only compile for sm_90 and print ptxas's report")
    ap.add_argument("--cases", nargs="+", choices=[c[0] for c in CASES], default=[c[0] for c in CASES])
    args = ap.parse_args()
    if args.ptxas:
        for tile in TILES:
            print(tile, {v: ptxas(v, tile) for v in VARIANTS})
        return
    for B, N, H, Hkv, D, causal in [(2, 1040, 4, 4, 128, True), (1, 1040, 8, 2, 128, False), (1, 1040, 8, 1, 64, True)]:
        q, k, v, do = _inputs(B, N, H, Hkv, D, 1)
        o, lse = triton_attn_fwd(q, k, v, AttnSpec(causal=causal))
        ref = triton_attn_bwd(do, q, k, v, o, lse, AttnSpec(causal=causal))
        for variant in VARIANTS:
            got = fused_attn_bwd(do, q, k, v, o, lse, causal, variant)
            err = [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, ref)]
            print(f"B{B} N{N} H{H}/{Hkv} D{D} causal={causal} {variant}: relative difference to the two kernels "
                  f"dq {err[0]:.1e} dk {err[1]:.1e} dv {err[2]:.1e}", flush=True)
    for label, B, N, H, Hkv, D, causal in (c for c in CASES if c[0] in args.cases):
        q, k, v, do = _inputs(B, N, H, Hkv, D, 0)
        o, lse = triton_attn_fwd(q, k, v, AttnSpec(causal=causal))
        flops = attn_flops(B, H, N, N, D, causal, "bwd")
        two = time_ms(lambda: triton_attn_bwd(do, q, k, v, o, lse, AttnSpec(causal=causal)))  # noqa: B023
        print(json.dumps(dict(case=label, impl="two kernels", ms=round(two, 3), tflops=round(flops / two * 1e-9))))
        for tile in TILES if label == "D128 N16k causal" else TILES[:3]:
            for variant in VARIANTS:
                ms = time_ms(lambda: fused_attn_bwd(do, q, k, v, o, lse, causal, variant, tile))  # noqa: B023
                print(json.dumps(dict(case=label, impl=f"fused {variant}", tile=tile, ms=round(ms, 3),
                                      vs_two_kernels=round(two / ms, 3))), flush=True)


if __name__ == "__main__":
    main()
