"""Experiment: a Hopper attention forward in Gluon, Triton's explicit dialect, beside the Triton kernel.

    python docs/experiments/gluon_fwd.py            # on an H100/H200: exactness, then TFLOP/s
    python docs/experiments/gluon_fwd.py --ptxas    # any machine: what ptxas makes of each variant

What Triton decides for itself, this kernel states: Q and a 3-slot ring of K/V tiles arrive by TMA
on mbarriers, each slot refilled once the P·V that read it has retired; both matrix multiplies are
asynchronous wgmma whose waits are placed by hand. `OVERLAP` says where:
  0  every wgmma waited at once (the plain FA2 loop);
  1  the next key block's S = Q·Kᵀ issued before this block's softmax and waited after P·V, so the
     exponentials run beside the tensor cores (FlashAttention-3's intra-warpgroup overlap);
  2  as 1, and P·V left in flight into the next iteration too; ptxas then serialises the wgmmas
     (warning C7514: the loop-carried accumulator is touched while in flight).
Two warpgroups of 64 query rows each (8 warps), 128-row query blocks, dense causal or full
attention, bf16/fp16, D = 64 or 128, GQA. Causal needs BLOCK_N = 128: only the last key block is
masked. `gluon_attn_fwd_ws` is the next step of FlashAttention-3's structure: a one-warp TMA loader
partition (`gl.warp_specialize`) fills the ring while the two consumer warpgroups, given 240
registers each by `setmaxnreg`, only compute (overlap as 1). The outcome is in docs/PERF_NOTES.md
("Gluon"): none of them beats the Triton kernel. The step after, each consumer warpgroup a
partition of its own, is the hopper backend's forward (kernels/hopper_fwd.py): the variants here
call its online softmax, its loop (`_attend`) and its epilogue (`_finish`).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

sys.path.append(str(Path(__file__).resolve().parents[2]))  # tests.truth, last: ringflash stays the installed one
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch"))  # benchlib, kernel_report
from benchlib import attn_flops, time_ms
from kernel_report import SM90, ptxas_info

from ringflash.kernels import AttnSpec
from ringflash.kernels.hopper import rows_descriptor, smem_layout, tma_load
from ringflash.kernels.hopper_fwd import _attend, _finish, _pv, _softmax  # the shipped forward's pieces
from ringflash.kernels.triton_fwd import triton_attn_fwd
from tests.truth import attention_f64

BLOCK_M = 128


@gluon.jit
def _refill(k_desc, v_desc, k_smem, v_smem, kv_bar, block, ok, b, kv_col, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, D: gl.constexpr):
    slot = block % STAGES
    mbarrier.expect(kv_bar.index(slot), 2 * BLOCK_N * D * k_desc.dtype.primitive_bitwidth // 8, pred=ok)
    tma_load(k_desc, [b, block * BLOCK_N, kv_col], kv_bar.index(slot), k_smem.index(slot),
                                    pred=ok)
    tma_load(v_desc, [b, block * BLOCK_N, kv_col], kv_bar.index(slot), v_smem.index(slot),
                                    pred=ok)


@gluon.jit
def _gl_attn_fwd(q_desc, k_desc, v_desc, o_desc, LSE, H, GROUP, Nq, Nk, qk_scale,
                 CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 D: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # causal: the heaviest query blocks first
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    kv_col = (h // GROUP) * D
    start_m = pid_m * BLOCK_M
    dtype: gl.constexpr = q_desc.dtype

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    q_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_bar.index(i), count=1)

    n_blocks = gl.cdiv(gl.minimum(start_m + BLOCK_M, Nk) if CAUSAL else Nk, BLOCK_N)
    mbarrier.expect(q_bar, BLOCK_M * D * dtype.primitive_bitwidth // 8)
    tma_load(q_desc, [b, start_m, h * D], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _refill(k_desc, v_desc, k_smem, v_smem, kv_bar, i, i < n_blocks, b, kv_col, BLOCK_N, STAGES, D)

    rows = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    if OVERLAP == 2:
        acc = warpgroup_mma_init(acc)  # loop-carried while in flight
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    q = q_smem.reshape([BLOCK_M, D])

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(kv_bar.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), s_zero, use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))

    for j in range(0, n_blocks - 1):  # every block but the last is seen whole: no mask
        nxt = j + 1
        mbarrier.wait(kv_bar.index(nxt % STAGES), (nxt // STAGES) & 1)
        s_next = warpgroup_mma(q, k_smem.index(nxt % STAGES).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)
        if OVERLAP == 0:
            s_next = warpgroup_mma_wait(0, deps=(s_next, ))
        if OVERLAP == 2:
            acc = warpgroup_mma_wait(1, deps=(acc, ))  # the previous P·V retired; S_next may still run
        # The previous block's P·V has retired, so its slot takes the block STAGES after it.
        _refill(k_desc, v_desc, k_smem, v_smem, kv_bar, j - 1 + STAGES, (j >= 1) & (j - 1 + STAGES < n_blocks), b,
                kv_col, BLOCK_N, STAGES, D)
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, qk_scale, rows, j * BLOCK_N + offs_n, Nk, False, CAUSAL)
        acc = _pv(acc, p, alpha, v_smem.index(j % STAGES).reshape([BLOCK_N, D]), o_layout, p_layout)
        if OVERLAP == 2:
            s = warpgroup_mma_wait(1, deps=(s_next, ))  # S_next retired; P·V may still run
        else:
            acc, s = warpgroup_mma_wait(0, deps=(acc, s_next))

    last = n_blocks - 1
    if OVERLAP == 2:
        acc = warpgroup_mma_wait(0, deps=(acc, ))
    p, alpha, l_i, m_i = _softmax(s, m_i, l_i, qk_scale, rows, last * BLOCK_N + offs_n, Nk, True, CAUSAL)
    acc = _pv(acc, p, alpha, v_smem.index(last % STAGES).reshape([BLOCK_N, D]), o_layout, p_layout)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_bar.index(i))
    mbarrier.invalidate(q_bar)

    lse_strides = (H * Nq, Nq, 1)  # LSE (B, H, Nq) contiguous; o goes by TMA (O and OA unused)
    _finish(acc, l_i, m_i, rows, q_smem, o_desc, LSE, LSE, LSE, lse_strides, lse_strides, lse_strides, b, h, start_m,
            Nq, True, False, BLOCK_M, D, num_warps)


def gluon_attn_fwd(q, k, v, causal: bool, overlap: int = 1, block_n: int = 128, stages: int = 3):
    """`(o, lse)` of `q (B, Nq, H, D)` against `k, v (B, Nk, Hkv, D)`, as `kernels.attn_fwd` returns them."""
    B, Nq, H, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    if causal and block_n != BLOCK_M:
        raise ValueError(f"block_n: causal masks only the last key block, so it must be {BLOCK_M}, got {block_n}")
    o = torch.empty_like(q)
    lse = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)
    _gl_attn_fwd[(triton.cdiv(Nq, BLOCK_M), B * H)](
        rows_descriptor(q, BLOCK_M), rows_descriptor(k, block_n), rows_descriptor(v, block_n),
        rows_descriptor(o, BLOCK_M), lse, H, H // Hkv, Nq, Nk,
        D ** -0.5 * 1.4426950408889634, CAUSAL=causal, OVERLAP=overlap, BLOCK_M=BLOCK_M, BLOCK_N=block_n, D=D,
        STAGES=stages, num_warps=8)
    return o, lse


@gluon.jit
def _ws_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, b, h, kv_col, start_m, n_blocks,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, D: gl.constexpr):
    mbarrier.expect(q_bar, BLOCK_M * D * q_desc.dtype.primitive_bitwidth // 8)
    tma_load(q_desc, [b, start_m, h * D], q_bar, q_smem)
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
        mbarrier.expect(ready.index(slot), 2 * BLOCK_N * D * k_desc.dtype.primitive_bitwidth // 8)
        tma_load(k_desc, [b, j * BLOCK_N, kv_col], ready.index(slot), k_smem.index(slot))
        tma_load(v_desc, [b, j * BLOCK_N, kv_col], ready.index(slot), v_smem.index(slot))


@gluon.jit
def _gl_attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, LSE, H, GROUP, Nq, Nk, qk_scale,
                    CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                    STAGES: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    kv_col = (h // GROUP) * D
    start_m = pid_m * BLOCK_M
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    n_blocks = gl.cdiv(gl.minimum(start_m + BLOCK_M, Nk) if CAUSAL else Nk, BLOCK_N)
    # The consumers are the shipped forward's loop (kernels/hopper_fwd.py), over all 8 warps of one
    # partition: its slot release then spans both warpgroups.
    acc, l_i, m_i, rows = gl.warp_specialize(
        [(_attend, (q_smem, k_smem, v_smem, q_bar, ready, empty, start_m, n_blocks, n_blocks - 1, Nk, qk_scale, CAUSAL,
                    BLOCK_M, BLOCK_N, D, STAGES, num_warps)),
         (_ws_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, b, h, kv_col, start_m,
                       n_blocks, BLOCK_M, BLOCK_N, STAGES, D))],
        worker_num_warps=[1], worker_num_regs=[LOADER_REGS])
    lse_strides = (H * Nq, Nq, 1)  # LSE (B, H, Nq) contiguous; o goes by TMA (O and OA unused)
    _finish(acc, l_i, m_i, rows, q_smem, o_desc, LSE, LSE, LSE, lse_strides, lse_strides, lse_strides, b, h, start_m,
            Nq, True, False, BLOCK_M, D, num_warps)


def gluon_attn_fwd_ws(q, k, v, causal: bool, block_n: int = 128, stages: int = 3, loader_regs: int = 24):
    """As `gluon_attn_fwd`, with a one-warp TMA loader beside the two consumer warpgroups."""
    B, Nq, H, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)
    _gl_attn_fwd_ws[(triton.cdiv(Nq, BLOCK_M), B * H)](
        rows_descriptor(q, BLOCK_M), rows_descriptor(k, block_n), rows_descriptor(v, block_n),
        rows_descriptor(o, BLOCK_M), lse, H, H // Hkv, Nq, Nk,
        D ** -0.5 * 1.4426950408889634, CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_N=block_n, D=D, STAGES=stages,
        LOADER_REGS=loader_regs, num_warps=8)
    return o, lse


def ptxas_report(causal: bool, overlap: int | None, head_dim: int = 128, block_n: int = 128, stages: int = 3) -> str:
    """Registers, spills and wgmma serialisation for sm_90, compiled here without a GPU; overlap None:
    the warp-specialised kernel."""
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(rows):
        return f"tensordesc<bf16[1,{rows},{head_dim}],{smem_layout([1, rows, head_dim], gl.bfloat16)!r}>"

    consts = dict(CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_N=block_n, D=head_dim, STAGES=stages, num_warps=8)
    consts.update(OVERLAP=overlap) if overlap is not None else consts.update(LOADER_REGS=24)
    sig = dict(q_desc=desc(BLOCK_M), k_desc=desc(block_n), v_desc=desc(block_n), o_desc=desc(BLOCK_M), LSE="*fp32",
               H="i32", GROUP="i32", Nq="i32", Nk="i32", qk_scale="fp32", **{c: "constexpr" for c in consts})
    fn = _gl_attn_fwd if overlap is not None else _gl_attn_fwd_ws
    info = ptxas_info(triton.compile(GluonASTSource(fn, sig, consts), target=SM90, options={"num_warps": 8}))
    return (f"{info['registers']} registers, {info['spill_stores']} B spilled, "
            f"serialised: {'yes (C7514)' if info['serialised'] else 'no'}")


def _exactness() -> None:
    for B, N, H, Hkv, D, causal in [(2, 1000, 4, 4, 128, True), (1, 777, 8, 2, 64, False), (2, 1024, 4, 1, 128, True),
                                    (1, 300, 2, 2, 128, False), (1, 2048, 4, 4, 64, True)]:
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(B, N, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        truth = attention_f64(q, k, v, causal)
        o64, lse64 = truth["o"], truth["lse"]
        line = f"B{B} N{N} H{H}/{Hkv} D{D} causal={causal}: max |o - o64|: triton "
        line += f"{float((triton_attn_fwd(q, k, v, AttnSpec(causal=causal))[0].double() - o64).abs().max()):.2e}"
        for overlap in (0, 1, 2, None):
            if overlap is None:
                o, lse = gluon_attn_fwd_ws(q, k, v, causal)
            else:
                o, lse = gluon_attn_fwd(q, k, v, causal, overlap)
            line += (f", gluon {overlap if overlap is not None else 'ws'} {float((o.double() - o64).abs().max()):.2e}"
                     f" (lse {float((lse.double() - lse64).abs().max()):.1e})")
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ptxas", action="store_true", help="only compile for sm_90 and print ptxas's report")
    args = ap.parse_args()
    if args.ptxas:
        for causal in (True, False):
            for overlap in (0, 1, 2, None):
                name = f"overlap={overlap}" if overlap is not None else "warp-specialised"
                print(f"D128 causal={causal} {name}: {ptxas_report(causal, overlap)}")
        return

    _exactness()
    for case in [("D128 N16k causal", 2, 16384, 16, 128, True), ("D128 N16k full", 2, 16384, 16, 128, False),
                 ("D128 N4k causal", 8, 4096, 16, 128, True), ("D64 N16k causal", 2, 16384, 32, 64, True)]:
        _bench(*case)


def _bench(label, B, N, H, D, causal) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    fns = {"triton": lambda: triton_attn_fwd(q, k, v, AttnSpec(causal=causal)), "cudnn": cudnn}
    fns.update({f"gluon overlap={ov}": (lambda ov=ov: gluon_attn_fwd(q, k, v, causal, ov)) for ov in (0, 1, 2)})
    fns["gluon warp-specialised"] = lambda: gluon_attn_fwd_ws(q, k, v, causal)
    times = {name: [] for name in fns}
    for _ in range(2):  # interleaved rounds: drift falls on every variant
        for name, fn in fns.items():
            times[name].append(time_ms(fn, rep_ms=250))
    flops = attn_flops(B, H, N, N, D, causal)
    for name, ms in times.items():
        print(json.dumps(dict(case=label, impl=name, ms=[round(t, 3) for t in ms],
                              tflops=[round(flops / t * 1e-9) for t in ms])), flush=True)

if __name__ == "__main__":
    main()
