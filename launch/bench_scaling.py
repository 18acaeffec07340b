"""Scaling of context parallelism: ring (u = 1), head-parallel (r = 1) and the hybrid (u × r) on W GPUs.

    torchrun --standalone --nproc_per_node=8 launch/bench_scaling.py                    # 8k, 32k/GPU; 256k total
    torchrun --standalone --nproc_per_node=4 launch/bench_scaling.py --tokens-per-gpu 8k --total 256k
    torchrun --standalone --nproc_per_node=4 launch/bench_scaling.py --smoke --record-to /tmp/x   # CPU, gloo

One run measures one world size W (run it at 2, 4 and 8 GPUs for the scaling curves; launch/
multigpu_runs.sh does). For each attention shape (--shapes: `gqa` = Llama-3-8B's H 32, Hkv 8,
D 128; `mha` = H = Hkv = 32, D 128) and each grid of u head ranks × r = W/u ring ranks
(--grids, default every u in {1, 2, 4, W} that divides W and the heads: u = 1 is the ring,
u = W pure head parallelism, the rest the hybrid; groups from `ringflash.hybrid_groups(u)`):
- weak scaling: --tokens-per-gpu N (sequence W·N), and
- strong scaling: --total T tokens (T/W per GPU),
causal, zigzag, B = 1, bf16 on GPUs (float32 on CPU), the ring's blocks over NCCL:
- fwd+bwd ms: `ring_flash_attn_func(..., group=ring_group, head_group=head_group)` forward +
  `autograd.grad`, the slowest rank's median (ringflash.bench.time_collective);
- single/W ms: one GPU's fwd+bwd of the whole sequence with the same kernels, ÷ W;
- efficiency = (single/W) ÷ fwd+bwd (bench_ring's and ring-flash-attention's definition);
- predicted ms: the planner's (`ringflash.plan.predict`, default Cluster: 8 GPUs per node, the
  kernel rates of benchmarks/kernels.jsonl) for the same model, sequence and (u, r); predicted
  efficiency: the planner's one-GPU time ÷ W over its (u, r) time, the same definition;
- torch CP: `context_parallel` (flash and cuDNN SDPA; the mha shape only, as bench_ring: it
  has no GQA) beside the ring, efficiency against SDPA on one GPU with the same backend.
A single-GPU reference that runs out of memory leaves its efficiency empty (noted).
Rank 0 appends one record to benchmarks/scaling.jsonl (--record-to another directory,
--no-record none). --smoke: CPU gloo, tiny shapes (H 4, Hkv 2 / 4, D 16, 32 tokens per GPU and
a 4·W total), 2 iterations, reference kernels; records only with --record-to. The timings of a
smoke run mean nothing; it checks the script.
"""

from __future__ import annotations

import argparse
import os
import types
from pathlib import Path

import torch
import torch.distributed as dist

from ringflash import hybrid_groups, nccl_options, ring_flash_attn_func
from ringflash.bench import (
    BENCHMARKS_DIR,
    attn_flops,
    bench_single,
    bench_single_sdpa,
    bench_torch_cp,
    exit_without_teardown,
    parse_tokens,
    record,
    time_collective,
    tokens_label,
)
from ringflash.hybrid import kv_heads_per_rank
from ringflash.plan import Cluster, KernelRates, Model, predict

SHAPES = {"gqa": (32, 8, 128), "mha": (32, 32, 128)}  # (H, Hkv, D): Llama-3-8B attention; no GQA
SMOKE_SHAPES = {"gqa": (4, 2, 16), "mha": (4, 4, 16)}
HEADERS = ["scaling", "W", "shape", "tokens/GPU", "sequence", "impl", "u", "r", "fwd+bwd ms", "single/W ms",
           "efficiency", "predicted ms", "predicted efficiency", "TFLOP/s/GPU"]  # fmt: skip


def grids(world: int, heads: int, kv_heads: int, wanted: list[int] | None) -> list[tuple[int, int]]:
    """(u, r) of every grid to measure: u in `wanted` (default 1, 2, 4, W) dividing W and the heads."""
    out = []
    for u in wanted or sorted({1, 2, 4, world}):
        if u > world or world % u or heads % u:
            continue
        try:
            kv_heads_per_rank(heads, kv_heads, u)
        except ValueError:
            continue
        out.append((u, world // u))
    return out


def impl_name(u: int, r: int) -> str:
    return "ring" if u == 1 else "head-parallel" if r == 1 else "hybrid"


class Groups:
    """`hybrid_groups(u)` once per u (every rank creates every group, in the same order)."""

    def __init__(self):
        self.cache: dict[int, tuple] = {}

    def __call__(self, u: int):
        if u == 1:
            return None, None
        if u not in self.cache:
            self.cache[u] = hybrid_groups(u)
        return self.cache[u]


def bench_grid(args, groups: Groups, u: int, n_global: int, shape, dev, dtype) -> float:
    """fwd+bwd ms of the (u, W/u) grid on an `n_global`-token sequence (random inputs, this rank's piece)."""
    H, Hkv, D = shape
    ring_group, head_group = groups(u)
    n_local = n_global // dist.get_world_size()  # random data: which piece a rank holds does not change the work
    q = torch.randn(1, n_local, H, D, device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, n_local, Hkv, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)

    def fwd_bwd():
        o = ring_flash_attn_func(q, k, v, causal=True, layout="zigzag", group=ring_group, head_group=head_group,
                                 backend=args.backend, transport="nccl")  # fmt: skip
        torch.autograd.grad(o, (q, k, v), do)

    return time_collective(fwd_bwd, args.iters, args.warmup)


def single_ms(args, cache: dict, n_global: int, shape, dev, dtype, sdpa: str | None = None) -> float | None:
    """One device's fwd+bwd ms on the whole sequence (our kernels, or SDPA's `sdpa` backend); None if out of memory."""
    key = (n_global, shape, sdpa)
    if key not in cache:
        H, Hkv, D = shape
        a = types.SimpleNamespace(batch=1, heads=H, kv_heads=Hkv, head_dim=D, iters=args.iters, warmup=args.warmup,
                                  profile=False)  # fmt: skip
        try:
            if sdpa:
                cache[key] = bench_single_sdpa(a, n_global, dev, dtype, sdpa)
            else:
                cache[key] = bench_single(a, n_global, dev, dtype, args.backend)
        except torch.OutOfMemoryError:
            cache[key] = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return cache[key]


def predicted(rates, n_global: int, shape, u: int, r: int) -> tuple[float, float]:
    """The planner's (ms, efficiency in this benchmark's definition) for the grid."""
    H, Hkv, D = shape
    m = Model(H, Hkv, D)
    c = Cluster()
    t = predict(m, n_global, c, u, r, "nccl", "zigzag", rates).time_s
    one = predict(m, n_global, c, 1, 1, "nccl", "zigzag", rates).time_s
    return t * 1e3, one / (u * r) / t


def _tokens_or_none(s: str) -> list[int]:
    """`parse_tokens`, with the empty string for none (to run weak or strong scaling alone)."""
    return parse_tokens(s) if s else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-gpu", type=_tokens_or_none, default=parse_tokens("8k,32k"),
                   help="weak scaling: tokens per GPU (empty string: none)")
    p.add_argument("--total", type=_tokens_or_none, default=parse_tokens("256k"),
                   help="strong scaling: fixed sequences (empty string: none)")
    p.add_argument("--shapes", default="gqa,mha", help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--grids", default=None, help="comma-separated head-parallel degrees u (default 1,2,4,W)")
    p.add_argument("--backend", default=None, help="kernel backend (default: triton on CUDA, auto on CPU)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-torch-cp", action="store_true", help="skip torch's context_parallel")
    p.add_argument("--smoke", action="store_true", help="CPU gloo, tiny shapes: checks the script (see above)")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--record-to", type=Path, default=None, help=f"records' directory (default {BENCHMARKS_DIR})")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available() and not args.smoke
    shapes_table = SMOKE_SHAPES if args.smoke else SHAPES
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in shapes_table:
            p.error(f"--shapes: each must be one of {sorted(shapes_table)}, got {s!r}")
    args.backend = args.backend or ("triton" if cuda else "auto")
    if args.smoke:
        args.iters, args.warmup = 2, 1
    record_to = None if args.no_record else args.record_to or (None if args.smoke else BENCHMARKS_DIR)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", pg_options=nccl_options())
    else:
        dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        dev = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        dtype = torch.bfloat16 if cuda else torch.float32
        if args.smoke:
            args.tokens_per_gpu, args.total = [32], [4 * 32 * world]
        wanted = [int(x) for x in args.grids.split(",")] if args.grids else None
        cases = [("weak", n * world) for n in args.tokens_per_gpu] + [("strong", t) for t in args.total]
        rates = KernelRates.from_records()
        groups, cache, rows, notes = Groups(), {}, [], []
        for shape_name in shapes:
            shape = shapes_table[shape_name]
            H, Hkv, D = shape
            for mode, n_global in cases:
                if n_global % (2 * world):
                    notes.append(f"{mode} {n_global}: not a multiple of 2·W, skipped")
                    continue
                flops = attn_flops(1, H, n_global, n_global, D, True, "fwd_bwd") / world
                one = single_ms(args, cache, n_global, shape, dev, dtype)
                if one is None:
                    notes.append(f"{shape_name} {tokens_label(n_global)}: one GPU out of memory, no efficiency")
                base = [mode, world, shape_name, n_global // world, n_global]
                for u, r in grids(world, H, Hkv, wanted):
                    ms = bench_grid(args, groups, u, n_global, shape, dev, dtype)
                    p_ms, p_eff = predicted(rates, n_global, shape, u, r)
                    single_w = None if one is None else one / world
                    eff = None if one is None else single_w / ms
                    rows.append([*base, impl_name(u, r), u, r, ms, single_w, eff, p_ms, p_eff, flops / ms / 1e9])
                    if rank == 0:
                        print(f"{mode} {shape_name} W={world} {tokens_label(n_global)} {impl_name(u, r)} u={u} r={r}: "
                              f"{ms:.4g} ms, efficiency {eff if eff is None else round(eff, 3)}, "
                              f"predicted {p_ms:.4g} ms ({p_eff:.3f})")  # fmt: skip
                    if cuda:
                        torch.cuda.empty_cache()
                if args.no_torch_cp or not cuda or Hkv != H:
                    continue
                for sdpa in ("flash", "cudnn"):
                    a = types.SimpleNamespace(batch=1, heads=H, kv_heads=Hkv, head_dim=D, iters=args.iters,
                                              warmup=args.warmup, cp_rotate=None)  # fmt: skip
                    ms, why = bench_torch_cp(a, n_global, dev, dtype, sdpa)
                    if ms is None:
                        notes.append(f"torch CP ({sdpa}) {shape_name} {tokens_label(n_global)} n/a: {why}")
                        continue
                    own = single_ms(args, cache, n_global, shape, dev, dtype, sdpa)
                    own_w = None if own is None else own / world
                    rows.append([*base, f"torch CP ({sdpa})", 1, world, ms, own_w, None if own is None else own_w / ms,
                                 None, None, flops / ms / 1e9])  # fmt: skip
                    if cuda:
                        torch.cuda.empty_cache()
        if rank == 0:
            title = (f"Scaling: ring, head-parallel and hybrid on {world} ranks ({dist.get_backend()}), "
                     f"{'bf16' if cuda else 'float32'}, causal, zigzag"
                     + (" (smoke run: timings meaningless)" if args.smoke else ""))  # fmt: skip
            text = ("efficiency = (one GPU's fwd+bwd on the whole sequence with the same kernels ÷ W) ÷ fwd+bwd; "
                    "predicted = ringflash.plan.predict (default Cluster, kernels.jsonl rates), its efficiency "
                    "the planner's one-GPU time ÷ W over its grid time; torch CP efficiency against SDPA "
                    "with the same backend on one GPU. " + " ".join(notes))  # fmt: skip
            run_args = {"world": world, "causal": True, "layout": "zigzag",
                        "shapes": {s: shapes_table[s] for s in shapes},
                        "tokens_per_gpu": args.tokens_per_gpu, "total": args.total, "grids": args.grids,
                        "backend": args.backend, "iters": args.iters, "warmup": args.warmup, "smoke": args.smoke,
                        "transport": "nccl" if cuda else "gloo"}  # fmt: skip
            peers = sorted({r[5] for r in rows if str(r[5]).startswith("torch CP")})
            record("scaling", title, HEADERS, rows, args=run_args, notes=text.strip(), peers=peers, directory=record_to)
        dist.barrier()  # tear down together (see bench_ring)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
