"""Ring attention benchmark: forward+backward time, efficiency, compute alone, torch's context_parallel.

    torchrun --standalone --nproc_per_node=2 launch/bench_ring.py                  # 8k, 32k, 128k tokens/rank
    torchrun --standalone --nproc_per_node=2 launch/bench_ring.py --tokens-per-rank 32k --no-torch-cp
    torchrun --standalone --nproc_per_node=2 launch/bench_ring.py --quick          # smoke run (CPU: gloo)
    torchrun --standalone --nproc_per_node=2 launch/bench_ring.py --masks --tokens-per-rank 128k --window 4k

Per tokens-per-rank N (global sequence W·N), bf16, causal, D = 128, H = 16 (H·D = 2048), B = 1:
- ring fwd / fwd+bwd: `ring_flash_attn_func` forward (no grad) and forward + `autograd.grad`, as
  users call it (cross-rank input check included unless --no-check-ranks), for the zigzag and
  contiguous layouts, and on CUDA for each transport (NCCL, copy engine; --transports).
- compute only: each rank's per-step kernels and merges (`ringflash.NullComm`: no transfers), the
  slowest rank's (the ring runs at its pace; rank 0 prints every rank's).
  ring − compute is what communication costs beyond overlap; compute − single/W is what cutting
  the work into per-step blocks costs.
- single/W: one GPU's fwd+bwd on the whole sequence with the same kernels, divided by W (for
  torch CP: SDPA with the same backend, so its efficiency measures its ring, not its kernels).
- kernels (--kernel-backends, default `triton,cudnn` on CUDA): every ringflash row is run with
  each kernel backend (`kernels.attn_fwd`'s `backend=`); "ringflash [cudnn]" is our ring on
  cuDNN's attention kernels (kernels/cudnn.py), its efficiency relative to cuDNN on one GPU.
- efficiency = (single/W) ÷ ring fwd+bwd (the definition of ring-flash-attn's README).
- hop: one K/V transfer alone per transport, ms and GB/s (the record's `ceilings`): the
  bandwidth the overlap has to work with.
- predicted ms: the planner's fwd+bwd for each ringflash row (`ringflash.plan.predict`: one node
  of W H100/H200s, the shipped rates of the kernels the row's backend runs, its transport and
  layout), made before measuring, the model's version in the record's args (`plan_model`):
  `python -m ringflash.plan_validation` reads them as held out.
- torch CP: `torch.distributed.tensor.experimental.context_parallel` (head-tail load balancing,
  torch's default rotate method unless --cp-rotate) with the SDPA flash and cuDNN backends;
  'n/a' with the reason where unavailable.
--masks: instead, at the same tokens per rank (zigzag unless --layouts), dense causal against
packed documents (lengths log-uniform in [--doc-min, --doc-max], default 1k–64k, from a fixed
seed; not multiples of anything) and against a causal sliding window (--window, default 4k),
each through `ringflash.ring_mask`; with the visible fraction of dense causal's (query, key)
pairs, rank 0's skipped ring steps, and the speed-up over dense. The K/V of skipped steps still
travel (ringflash/masks.py's cost model), so ring − compute-only shows what the mask cannot save.
Ring timings use a fixed iteration count on every rank (collectives must match), run back to
back between CUDA events; the median of 5 such runs, and the slowest rank's. Single-device timings use
`ringflash.bench.time_ms`. Without CUDA, timings use time.perf_counter (smoke runs only).
Rank 0 prints the table and appends it to benchmarks/ring.jsonl (not for --no-record, nor for --quick
unless --record-to names a directory); `python launch/benchmarks_md.py` then regenerates BENCHMARKS.md
and docs/bench_ring.png.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ringflash import NullComm, kernels, nccl_options, ring_flash_attn_func, ring_mask
from ringflash.bench import (
    BENCHMARKS_DIR,
    PRIMING_CALLS,
    attn_flops,
    bench_single,
    bench_single_sdpa,
    bench_torch_cp,
    doc_lengths,
    exit_without_teardown,
    parse_tokens,
    profile_calls,
    record,
    time_collective,
    time_local,
    visible_fraction,
)
from ringflash.layout import ring_schedule
from ringflash.plan import Cluster, Model, model_version, predict
from ringflash.ring import ring_backward, ring_forward
from ringflash.transport import TRANSPORTS, ring_comm

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bench_ring(args, n_local, layout, dev, dtype, mask=None, transport="nccl", compute=True, backend=None):
    """(fwd ms, fwd+bwd ms, compute-only fwd+bwd ms or None) of this layout (under `mask`, a
    RingMask), the blocks moved by `transport`, on the kernel `backend` (None: the default);
    compute-only (no transfers) only if `compute`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    B, H, Hkv, D = args.batch, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(B, n_local, H, D, device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, n_local, Hkv, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)

    opts = dict(
        causal=True, layout=layout, check_ranks=args.check_ranks, mask=mask, transport=transport, backend=backend
    )

    def fwd():
        with torch.no_grad():
            ring_flash_attn_func(q, k, v, **opts)

    def fwd_bwd():
        o = ring_flash_attn_func(q, k, v, **opts)
        torch.autograd.grad(o, (q, k, v), do)

    null = NullComm(rank, world)
    plan = ring_schedule(rank, world, n_local, True, layout) if mask is None else list(mask.steps)
    step_opts = dict(scale=D**-0.5, kernels=kernels.get_backend(backend, q.device), comm=null)

    def compute_only():
        o, lse, kv = ring_forward(q.detach(), k.detach(), v.detach(), plan, **step_opts)
        ring_backward(do, q.detach(), kv, o, lse, plan, **step_opts)

    if args.profile:
        name = f"{n_local}_{layout}_{backend or 'default'}_{transport}"
        profile_calls(
            fwd_bwd, f"ring fwd+bwd ({transport}), {layout}, {n_local} tokens/rank", args.trace_dir, f"ring_{name}"
        )
        if compute:
            title = f"compute only, {layout}, {n_local} tokens/rank"
            profile_calls(compute_only, title, args.trace_dir, f"compute_{name}")
    fwd_ms = time_collective(fwd, args.iters, args.warmup)
    fwd_bwd_ms = time_collective(fwd_bwd, args.iters, args.warmup)
    if not compute:
        return fwd_ms, fwd_bwd_ms, None
    # The ring runs at its slowest rank's pace (ranks' step shapes differ), so compare with that.
    compute_ms = [None] * world
    dist.all_gather_object(compute_ms, time_local(compute_only, args.iters, args.warmup))
    if rank == 0:
        kernels_used = f" ({backend} kernels)" if backend else ""
        print(
            f"{n_local} tokens/rank {layout}{kernels_used}: compute only per rank "
            + ", ".join(f"{t:.3g}" for t in compute_ms)
        )
    return fwd_ms, fwd_bwd_ms, max(compute_ms)


def bench_hop(args, n_local, dev, dtype, transport) -> tuple[float, int]:
    """(ms, bytes) of one K/V hop alone, as the ring posts it (`RingComm.send_recv`): this rank's K
    and V to the next rank while the previous rank's arrive, with no compute to hide behind. The
    bandwidth the ring's overlap has to work with."""
    comm = ring_comm(None, transport)
    kv = torch.randn(2, args.batch, n_local, args.kv_heads, args.head_dim, device=dev).to(dtype)
    comm.reserve(kv)
    recv = comm.buffer("kv0", kv.shape, kv.dtype, kv.device)
    ms = time_collective(lambda: comm.send_recv(kv, recv).wait(), args.iters, args.warmup)
    return ms, kv.numel() * kv.element_size()


def bench_masks(args, n_local, layout, dev, dtype) -> list[list]:
    """Rows of the --masks table: dense causal, packed documents, a window, at n_local tokens/rank."""
    world = dist.get_world_size()
    n_global = n_local * world
    lens = doc_lengths(n_global, args.doc_min, args.doc_max)
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))  # global, on the host
    variants = [
        ("dense causal", None, 1.0),
        (
            f"{len(lens)} docs {args.doc_min}–{args.doc_max}",
            ring_mask(doc, layout=layout, device=dev),
            visible_fraction(n_global, lens, None),
        ),
        (
            f"window {args.window}",
            ring_mask(None, seqlen=n_global, layout=layout, window=args.window, device=dev),
            visible_fraction(n_global, None, args.window),
        ),
    ]
    rows, dense = [], None
    for name, mask, frac in variants:
        fwd, fwd_bwd, compute = bench_ring(args, n_local, layout, dev, dtype, mask=mask)
        dense = dense or fwd_bwd
        skipped = 0 if mask is None else len(mask.skipped)
        rows.append([n_local, layout, name, frac, skipped, fwd, fwd_bwd, compute, dense / fwd_bwd])
        if dist.get_rank() == 0:
            print(f"{n_local} tokens/rank {layout} {name}: fwd+bwd {fwd_bwd:.3g} ms, {dense / fwd_bwd:.2f}x dense")
    return rows


def predicted_ms(args, n_global: int, world: int, backend: str, transport: str, layout: str) -> float:
    """The planner's fwd+bwd ms for a ring row (one node of `world` H100/H200s, at the shipped rates
    of the kernels `backend` runs; stripe, balanced at every step, as zigzag)."""
    m = Model(args.heads, args.kv_heads, args.head_dim, batch=args.batch, dtype_bytes=DTYPES[args.dtype].itemsize)
    predicted_as = "contiguous" if layout == "contiguous" else "zigzag"
    pred = predict(m, n_global, Cluster(gpus_per_node=world), 1, world, transport, predicted_as, backend=backend)
    return round(pred.time_s * 1e3, 3)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-rank", type=parse_tokens, default=parse_tokens("8k,32k,128k"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--layouts", default="zigzag,contiguous")
    p.add_argument("--iters", type=int, default=10, help="timed iterations of the ring (fixed on every rank)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--no-check-ranks",
        dest="check_ranks",
        action="store_false",
        help="skip the per-call cross-rank input check (a host round trip per call)",
    )
    p.add_argument("--no-torch-cp", action="store_true", help="skip torch's context_parallel")
    p.add_argument(
        "--kernel-backends",
        default=None,
        help="comma-separated kernel backends for the ringflash rows (default: triton,cudnn on CUDA)",
    )
    p.add_argument(
        "--transports",
        default=None,
        help="comma-separated ringflash transports to compare (default: nccl,copy-engine on CUDA, nccl on CPU)",
    )
    p.add_argument("--cp-rotate", choices=["allgather", "alltoall"], default=None)
    p.add_argument(
        "--nccl-priority",
        choices=["high", "default"],
        default="high",
        help="the NCCL group's stream priority: high (ringflash.nccl_options(), as train/ uses) or default",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny shapes, 2 iterations, no record unless --record-to: a smoke run"
    )
    p.add_argument("--no-record", action="store_true", help="print only; do not append to the records")
    p.add_argument(
        "--record-to",
        type=Path,
        default=None,
        help=f"directory of the JSON-lines records (default {BENCHMARKS_DIR}, none for --quick)",
    )
    p.add_argument("--profile", action="store_true", help="torch.profiler kernel tables: ring, compute only, single")
    p.add_argument("--trace-dir", default=None, help="with --profile: keep every rank's chrome traces there")
    p.add_argument("--masks", action="store_true", help="dense causal vs packed documents vs a window (see above)")
    p.add_argument("--doc-min", type=parse_tokens, default=parse_tokens("1k"), help="--masks: shortest document")
    p.add_argument("--doc-max", type=parse_tokens, default=parse_tokens("64k"), help="--masks: longest document")
    p.add_argument("--window", type=parse_tokens, default=parse_tokens("4k"), help="--masks: window (keys seen)")
    return p


def parse_args() -> tuple[argparse.Namespace, list[str], list[str]]:
    """The arguments as resolved (--quick's shapes, defaults that depend on CUDA), and the
    transports and kernel backends to run, checked."""
    p = _parser()
    args = p.parse_args()
    args.doc_min, args.doc_max, args.window = args.doc_min[0], args.doc_max[0], args.window[0]
    if args.quick:
        args.tokens_per_rank, args.heads, args.head_dim, args.iters, args.warmup = [256], 2, 32, 2, 1
        args.doc_min, args.doc_max, args.window = 5, 200, 32
    args.kv_heads = args.kv_heads or args.heads
    args.record_to = None if args.no_record else args.record_to or (None if args.quick else BENCHMARKS_DIR)

    cuda = torch.cuda.is_available()
    transports = args.transports.split(",") if args.transports else (list(TRANSPORTS) if cuda else ["nccl"])
    for t in transports:
        if t not in TRANSPORTS or (t == "copy-engine" and not cuda):
            p.error(f"--transports: each must be one of {TRANSPORTS} (copy-engine needs CUDA), got {t!r}")
    backends = (args.kernel_backends or ("triton,cudnn" if cuda else "auto")).split(",")
    for b in backends:
        if b not in kernels.BACKENDS or (b in ("triton", "cudnn", "hopper") and not cuda):
            p.error(
                f"--kernel-backends: each must be one of {kernels.BACKENDS} (triton, cudnn, hopper need CUDA), "
                f"got {b!r}"
            )
    args.transports, args.kernel_backends = ",".join(transports), ",".join(backends)  # as resolved, for the record
    return args, transports, backends


def init_distributed(args, cuda: bool) -> int:
    """The local rank, its device set and the process group started (NCCL on GPUs, else gloo)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    if cuda:  # high-priority streams (ringflash.nccl_options) unless --nccl-priority default
        dist.init_process_group("nccl", pg_options=nccl_options() if args.nccl_priority == "high" else None)
    else:
        dist.init_process_group("gloo")
    return local_rank


def main() -> None:
    args, transports, backends = parse_args()
    cuda = torch.cuda.is_available()
    local_rank = init_distributed(args, cuda)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        dev = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        dtype = DTYPES[args.dtype]
        layouts = args.layouts.split(",")
        if args.masks:
            _main_masks(args, dev, dtype, layouts if "--layouts" in sys.argv else ["zigzag"])
            return
        rows, hops = [], []
        for n in args.tokens_per_rank:
            n_global = n * world
            hops += _hop_rows(args, n, dev, dtype, transports)
            flops = attn_flops(args.batch, args.heads, n_global, n_global, args.head_dim, True, "fwd_bwd") / world
            rows += _ringflash_rows(args, n, flops, dev, dtype, layouts, transports, backends)
            rows += _torch_cp_rows(args, n, flops, dev, dtype)
            if cuda:
                torch.cuda.empty_cache()
        if rank == 0:
            _record_table(args, world, rows, hops, cuda)
        # Tear down together: a rank that destroys its gloo group while rank 0 still writes the
        # table made the other abort at exit now and then ("terminate called ...").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _hop_rows(args, n, dev, dtype, transports) -> list[dict]:
    """One K/V hop alone per transport at n tokens/rank: the record's `ceilings`."""
    hops = []
    for transport in transports:
        ms, nbytes = bench_hop(args, n, dev, dtype, transport)
        hops.append(
            {
                "tokens_per_rank": n,
                "transport": transport,
                "ms": float(f"{ms:.4g}"),
                "MiB": nbytes / 2**20,
                "GB/s": float(f"{nbytes / ms / 1e6:.4g}"),
            }
        )
    return hops


def _ringflash_rows(args, n, flops, dev, dtype, layouts, transports, backends) -> list[list]:
    """The ringflash rows at n tokens/rank (`flops`: a rank's share of fwd+bwd): each kernel
    backend × layout × transport."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n_global = n * world
    rows = []
    for backend in backends:
        single = bench_single(args, n_global, dev, dtype, backend, profile_calls if args.profile else None) / world
        for layout, transport in itertools.product(layouts, transports):
            first = transport == transports[0]  # compute-only does not depend on the transport
            predicted = predicted_ms(args, n_global, world, backend, transport, layout)  # before measuring
            fwd, fwd_bwd, compute = bench_ring(
                args, n, layout, dev, dtype, transport=transport, compute=first, backend=backend
            )
            tflops = flops / fwd_bwd / 1e9
            impl = "ringflash" + ("" if backend in ("auto", "triton") else f" [{backend}]")
            impl += "" if transport == "nccl" else f" ({transport})"
            row = [n, impl, layout, fwd, fwd_bwd, compute, single, single / fwd_bwd]
            rows.append([*row, tflops, predicted])
            if rank == 0:
                print(
                    f"{n} tokens/rank {impl} {layout}: fwd+bwd {fwd_bwd:.3g} ms, "
                    f"efficiency {single / fwd_bwd:.3f}"
                )
    return rows


def _torch_cp_rows(args, n, flops, dev, dtype) -> list[list]:
    """torch's context_parallel at n tokens/rank (`flops` as for ringflash), with the SDPA flash
    and cuDNN backends ('n/a' rows with the reason printed where unavailable); none for --no-torch-cp."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n_global = n * world
    rows = []
    for sdpa in () if args.no_torch_cp else ("flash", "cudnn"):
        ms, why = bench_torch_cp(args, n_global, dev, dtype, sdpa)
        if ms is None:
            rows.append([n, f"torch CP ({sdpa})", "head-tail", *["n/a"] * 6, None])
            if rank == 0:
                print(f"torch CP ({sdpa}) n/a: {why}")
        else:
            own = bench_single_sdpa(args, n_global, dev, dtype, sdpa) / world
            rows.append([n, f"torch CP ({sdpa})", "head-tail", None, ms, None, own, own / ms, flops / ms / 1e9,
                         None])  # fmt: skip
    return rows


def _record_table(args, world: int, rows: list[list], hops: list[dict], cuda: bool) -> None:
    """Print the table and append it to the records (rank 0)."""
    headers = [
        "tokens/rank",
        "impl",
        "layout",
        "fwd ms",
        "fwd+bwd ms",
        "compute-only ms",
        "single/W ms",
        "efficiency",
        "TFLOP/s/GPU",
        "predicted ms",
    ]
    title = (
        f"Ring attention, {world} ranks ({dist.get_backend()}), {args.dtype}, causal, "
        f"B={args.batch} H={args.heads} Hkv={args.kv_heads} D={args.head_dim}"
    )
    notes = (
        "efficiency = (single-GPU fwd+bwd of the whole sequence ÷ W, with the same implementation's "
        "kernels: ours for ringflash, cuDNN's for ringflash [cudnn], SDPA's flash/cuDNN for torch CP) ÷ "
        "ring fwd+bwd; compute-only = "
        "the slowest rank's per-step kernels without communication; cross-rank input check: "
        f"{'on' if args.check_ranks else 'off'}; torch CP rotate method: {args.cp_rotate or 'torch default'}; "
        f"NCCL stream priority: {args.nccl_priority if cuda else 'n/a (gloo)'}; ringflash rows: "
        f"blocks sent by {'NCCL' if cuda else 'gloo'} send/recv, or by the GPUs' copy engines where the "
        "impl says copy-engine (transport='copy-engine'); ring and torch CP times: "
        + (
            f"steady state, {PRIMING_CALLS} untimed calls queued before each timed run."
            if cuda
            else "host wall clock."
        )
        + " One K/V hop alone: sent to the next rank while the previous rank's arrives, nothing else "
        "running, the slowest rank's."
    )
    record(
        "ring",
        title,
        headers,
        rows,
        args=_record_args(args, world),
        notes=notes,
        peers=sorted({r[1] for r in rows if r[1].startswith("torch CP") and r[4] != "n/a"}),
        ceilings={"kv_hop_alone": hops},
        directory=args.record_to,
    )


def _main_masks(args, dev, dtype, layouts) -> None:
    rows = []
    for n in args.tokens_per_rank:
        for layout in layouts:
            rows += bench_masks(args, n, layout, dev, dtype)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        headers = ["tokens/rank", "layout", "mask", "visible", "skipped (rank 0)", "fwd ms", "fwd+bwd ms",
                   "compute-only ms", "vs dense"]  # fmt: skip
        title = (
            f"Ring attention with document/window masks, {dist.get_world_size()} ranks ({dist.get_backend()}), "
            f"{args.dtype}, causal, B={args.batch} H={args.heads} Hkv={args.kv_heads} D={args.head_dim}"
        )
        notes = (
            "visible = the mask's (query, key) pairs over dense causal's; skipped = ring steps rank 0 launches no "
            "kernel for (their K/V still travel); vs dense = dense causal fwd+bwd ÷ this fwd+bwd, same tokens per "
            f"rank; documents log-uniform in [{args.doc_min}, {args.doc_max}] tokens, seed 0; cross-rank input check: "
            f"{'on' if args.check_ranks else 'off'}."
        )
        record(
            "ring",
            title,
            headers,
            rows,
            args=_record_args(args, dist.get_world_size()),
            notes=notes,
            directory=args.record_to,
        )


def _record_args(args, world: int) -> dict:
    """The run's shapes and options, as its record keeps them."""
    keep = (
        "tokens_per_rank",
        "batch",
        "heads",
        "kv_heads",
        "head_dim",
        "dtype",
        "layouts",
        "iters",
        "warmup",
        "check_ranks",
        "kernel_backends",
        "transports",
        "cp_rotate",
        "nccl_priority",
        "masks",
        "doc_min",
        "doc_max",
        "window",
        "quick",
    )
    # The planner's model version beside its "predicted ms": plan_validation reads them as held out.
    return {"world": world, "causal": True, **{k: getattr(args, k) for k in keep}, "plan_model": model_version()}


if __name__ == "__main__":
    main()
    exit_without_teardown()
