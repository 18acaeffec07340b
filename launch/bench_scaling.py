"""Scaling of context parallelism: ring and all-gather (u = 1), head-parallel (r = 1) and the
hybrids (u × r) on W GPUs, dense causal and with packed documents.

    torchrun --standalone --nproc_per_node=8 launch/bench_scaling.py                    # 8k, 32k/GPU; 256k total
    torchrun --standalone --nproc_per_node=4 launch/bench_scaling.py --tokens-per-gpu 8k --total "" --docs
    torchrun --standalone --nproc_per_node=4 launch/bench_scaling.py --smoke --docs --record-to /tmp/x   # CPU, gloo

One run measures one world size W (run it at 2, 4 and 8 GPUs for the scaling curves; launch/
multigpu_runs.sh does). For each attention shape (--shapes: `gqa` = Llama-3-8B's H 32, Hkv 8,
D 128; `mha` = H = Hkv = 32, D 128), each grid of u head ranks × r = W/u ring ranks (--grids,
default every u in {1, 2, 4, W} that divides W and the heads; groups from
`ringflash.hybrid_groups(u)`) and each scheme (--schemes: `ring`, K/V passed around the ring;
`allgather`, K/V all-gathered in chunks of --heads-k-stride K/V heads; at u = 1 the scheme alone,
at 1 < u < W the hybrid around it; u = W, pure head parallelism, has no scheme and runs once):
- weak scaling: --tokens-per-gpu N (sequence W·N), and
- strong scaling: --total T tokens (T/W per GPU),
causal, zigzag, B = 1, bf16 on GPUs (float32 on CPU), over NCCL. Each row dense causal and, with
--docs, again with packed documents (lengths log-uniform in [--doc-min, --doc-max], seed 0, as
bench_ring.py --masks) through the scheme's mask (`ring_mask` / `gather_mask` over the ring group):
- fwd+bwd ms: `ring_flash_attn_func(..., group=ring_group, head_group=head_group, scheme=)`
  forward + `autograd.grad`, the slowest rank's median (ringflash.bench.time_collective);
- single/W ms: one GPU's fwd+bwd of the whole sequence with the same kernels, ÷ W (dense rows);
- efficiency = (single/W) ÷ fwd+bwd (bench_ring's and ring-flash-attention's definition);
- visible: the mask's (query, key) pairs over dense causal's; TFLOP/s/GPU counts those only;
- predicted ms: the planner's (`ringflash.plan.predict`, default Cluster: 8 GPUs per node, the
  shipped rates of the kernels --backend runs) for the same model, sequence, (u, r) and scheme
  (dense rows), made before measuring, the model's version in the record's args (`plan_model`);
  predicted efficiency: the planner's one-GPU time ÷ W over its (u, r) time;
- torch CP: `context_parallel` (flash and cuDNN SDPA; the mha shape only, as bench_ring: it
  has no GQA) beside the ring, efficiency against SDPA on one GPU with the same backend.
Rank 0 prints each row as it finishes (a run cut short still shows them) and at the end appends
one record to benchmarks/scaling.jsonl (--record-to another directory, --no-record none). A row
that fails (out of memory, say) on any rank is reported and skipped on every rank; a single-GPU
reference that runs out of memory leaves its efficiency empty (noted). --smoke: CPU gloo, tiny
shapes (H 4, Hkv 2 / 4, D 16, 32 tokens per GPU and a 4·W total, documents of 4–32 tokens),
2 iterations, reference kernels; records only with --record-to. The timings of a smoke run mean
nothing; it checks the script.
"""

from __future__ import annotations

import argparse
import functools
import os
import types
from pathlib import Path

import torch
import torch.distributed as dist

from ringflash import SCHEMES, gather_mask, hybrid_groups, nccl_options, ring_flash_attn_func, ring_mask
from ringflash.bench import (
    BENCHMARKS_DIR,
    attn_flops,
    bench_single,
    bench_single_sdpa,
    bench_torch_cp,
    doc_lengths,
    exit_without_teardown,
    fmt,
    parse_tokens,
    record,
    time_collective,
    tokens_label,
    visible_fraction,
)
from ringflash.hybrid import kv_heads_per_rank
from ringflash.plan import Cluster, Model, model_version, predict

SHAPES = {"gqa": (32, 8, 128), "mha": (32, 32, 128)}  # (H, Hkv, D): Llama-3-8B attention; no GQA
SMOKE_SHAPES = {"gqa": (4, 2, 16), "mha": (4, 4, 16)}
HEADERS = ["scaling", "W", "shape", "tokens/GPU", "sequence", "impl", "scheme", "mask", "visible", "u", "r",
           "fwd+bwd ms", "single/W ms", "efficiency", "predicted ms", "predicted efficiency",
           "TFLOP/s/GPU"]  # fmt: skip
DENSE = "dense causal"


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


def runs(grid: list[tuple[int, int]], schemes: list[str]) -> list[tuple[int, int, str]]:
    """(u, r, scheme) of every measurement: each scheme per grid, pure head parallelism (r = 1) once."""
    return [(u, r, s) for u, r in grid for s in (schemes[:1] if r == 1 else schemes)]


def impl_name(u: int, r: int, scheme: str) -> str:
    return scheme if u == 1 else "head-parallel" if r == 1 else "hybrid"


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


def bench_grid(args, groups: Groups, u: int, scheme: str, n_global: int, shape, dev, dtype,
               doc: torch.Tensor | None = None) -> float:  # fmt: skip
    """fwd+bwd ms of `scheme` on the (u, W/u) grid on an `n_global`-token sequence (random inputs,
    this rank's piece), dense causal or under the documents `doc` (global ids `(N_global,)`)."""
    H, Hkv, D = shape
    ring_group, head_group = groups(u)
    mask = None
    if doc is not None:  # the scheme's own mask type, over the group its K/V travel in
        build = ring_mask if scheme == "ring" else gather_mask
        mask = build(doc, group=ring_group, layout="zigzag", causal=True, device=dev)
    n_local = n_global // dist.get_world_size()  # random data: which piece a rank holds does not change the work
    q = torch.randn(1, n_local, H, D, device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, n_local, Hkv, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    extra = {"transport": "nccl"} if scheme == "ring" else {"heads_k_stride": args.heads_k_stride}

    def fwd_bwd():
        o = ring_flash_attn_func(q, k, v, causal=True, layout="zigzag", group=ring_group, head_group=head_group,
                                 backend=args.backend, scheme=scheme, mask=mask, **extra)  # fmt: skip
        torch.autograd.grad(o, (q, k, v), do)

    return time_collective(fwd_bwd, args.iters, args.warmup)


def guarded(fn, dev: torch.device):
    """`(fn(), "")`, or `(None, why)` on every rank when `fn` raised on any: a row that runs out of
    memory is skipped, not the run. Work is the same on every rank, so a failure is too, and it
    comes before the ranks part ways; one rank failing alone inside a collective would still hang
    the others until the group's timeout."""
    try:
        value, why = fn(), ""
    except Exception as e:  # out of memory above all; anything else is reported the same way
        value, why = None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    failed = torch.tensor([1.0 if why else 0.0], device=dev)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        return None, why or "failed on another rank"
    return value, ""


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


def predicted(backend: str, n_global: int, shape, u: int, r: int, scheme: str, stride: int) -> tuple[float, float]:
    """The planner's (ms, efficiency in this benchmark's definition) for the grid and scheme, at the
    shipped rates of the kernels `backend` runs them on (`ringflash.plan.predict`)."""
    H, Hkv, D = shape
    m = Model(H, Hkv, D)
    c = Cluster()
    t = predict(m, n_global, c, u, r, "nccl", "zigzag", None, scheme, stride, backend=backend).time_s
    one = predict(m, n_global, c, 1, 1, "nccl", "zigzag", backend=backend).time_s
    return t * 1e3, one / (u * r) / t


class Table:
    """Rows kept for the record and, on rank 0, printed as each one finishes."""

    def __init__(self, rank: int):
        self.rank, self.rows, self.notes = rank, [], []
        self.say("| " + " | ".join(HEADERS) + " |\n|" + "---|" * len(HEADERS))

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def add(self, row: list) -> None:
        self.rows.append(row)
        self.say("| " + " | ".join(fmt(x) for x in row) + " |")

    def skip(self, what: str, why: str) -> None:
        self.notes.append(f"{what} skipped ({why}).")
        self.say(f"skipped: {what}: {why}")


def measure(args, table: Table, groups: Groups, cache: dict, mode: str, n_global: int, shape_name: str,
            shape, dev, dtype, wanted) -> None:  # fmt: skip
    """Every (grid, scheme, mask) row of one shape and sequence, then torch CP's."""
    world = dist.get_world_size()
    H, Hkv, D = shape
    flops = attn_flops(1, H, n_global, n_global, D, True, "fwd_bwd") / world
    one = single_ms(args, cache, n_global, shape, dev, dtype)
    if one is None:
        table.notes.append(f"{shape_name} {tokens_label(n_global)}: one GPU out of memory, no efficiency.")
    masks = [(DENSE, None, 1.0)]
    if args.docs:
        lens = doc_lengths(n_global, args.doc_min, args.doc_max)
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        masks.append((f"{len(lens)} docs {tokens_label(args.doc_min)}–{tokens_label(args.doc_max)}", doc,
                      visible_fraction(n_global, lens, None)))  # fmt: skip
    base = [mode, world, shape_name, n_global // world, n_global]
    for u, r, scheme in runs(grids(world, H, Hkv, wanted), args.schemes):
        for mask_name, doc, visible in masks:
            dense = mask_name == DENSE
            # Predicted before measuring: plan_validation reads the stored prediction as held out.
            p_ms, p_eff = (predicted(args.backend, n_global, shape, u, r, scheme, args.heads_k_stride) if dense
                           else (None, None))  # fmt: skip
            what = f"{mode} {shape_name} {tokens_label(n_global)} {impl_name(u, r, scheme)} u={u} r={r} {mask_name}"
            ms, why = guarded(functools.partial(bench_grid, args, groups, u, scheme, n_global, shape, dev, dtype, doc),
                              dev)  # fmt: skip
            if ms is None:
                table.skip(what, why)
                continue
            single_w = None if one is None or not dense else one / world
            eff = None if single_w is None else single_w / ms
            table.add([*base, impl_name(u, r, scheme), scheme if r > 1 else "", mask_name, visible, u, r, ms,
                       single_w, eff, p_ms, p_eff, visible * flops / ms / 1e9])  # fmt: skip
    if args.no_torch_cp or dev.type != "cuda" or Hkv != H:
        return
    for sdpa in ("flash", "cudnn"):
        a = types.SimpleNamespace(batch=1, heads=H, kv_heads=Hkv, head_dim=D, iters=args.iters, warmup=args.warmup,
                                  cp_rotate=None)  # fmt: skip
        ms, why = bench_torch_cp(a, n_global, dev, dtype, sdpa)
        if ms is None:
            table.skip(f"torch CP ({sdpa}) {shape_name} {tokens_label(n_global)}", why)
            continue
        own = single_ms(args, cache, n_global, shape, dev, dtype, sdpa)
        own_w = None if own is None else own / world
        table.add([*base, f"torch CP ({sdpa})", "", DENSE, 1.0, 1, world, ms, own_w,
                   None if own is None else own_w / ms, None, None, flops / ms / 1e9])  # fmt: skip
        torch.cuda.empty_cache()


def _tokens_or_none(s: str) -> list[int]:
    """`parse_tokens`, with the empty string for none (to run weak or strong scaling alone)."""
    return parse_tokens(s) if s else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-gpu", type=_tokens_or_none, default=parse_tokens("8k,32k"),
                   help="weak scaling: tokens per GPU (empty string: none)")  # fmt: skip
    p.add_argument("--total", type=_tokens_or_none, default=parse_tokens("256k"),
                   help="strong scaling: fixed sequences (empty string: none)")  # fmt: skip
    p.add_argument("--shapes", default="gqa,mha", help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--grids", default=None, help="comma-separated head-parallel degrees u (default 1,2,4,W)")
    p.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, of {list(SCHEMES)}")
    p.add_argument("--heads-k-stride", type=int, default=1, help="allgather: K/V heads per gathered chunk")
    p.add_argument("--docs", action="store_true", help="each row also with packed documents (see above)")
    p.add_argument("--doc-min", type=parse_tokens, default=parse_tokens("1k"), help="--docs: shortest document")
    p.add_argument("--doc-max", type=parse_tokens, default=parse_tokens("64k"), help="--docs: longest document")
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
    args.schemes = args.schemes.split(",")
    for s in args.schemes:
        if s not in SCHEMES:
            p.error(f"--schemes: each must be one of {list(SCHEMES)}, got {s!r}")
    if args.heads_k_stride < 1:
        p.error(f"--heads-k-stride: must be a positive integer, got {args.heads_k_stride}")
    args.backend = args.backend or ("triton" if cuda else "auto")
    if args.smoke:
        args.iters, args.warmup = 2, 1
        args.doc_min, args.doc_max = 4, 32
    else:
        args.doc_min, args.doc_max = args.doc_min[0], args.doc_max[0]
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
        groups, cache, table = Groups(), {}, Table(rank)
        for shape_name in shapes:
            for mode, n_global in cases:
                if n_global % (2 * world):
                    table.skip(f"{mode} {n_global}", "not a multiple of 2·W")
                    continue
                measure(args, table, groups, cache, mode, n_global, shape_name, shapes_table[shape_name],
                        dev, dtype, wanted)  # fmt: skip
        if rank == 0:
            title = (f"Scaling: {', '.join(args.schemes)}, head-parallel and hybrids on {world} ranks "
                     f"({dist.get_backend()}), {'bf16' if cuda else 'float32'}, causal, zigzag"
                     + (" (smoke run: timings meaningless)" if args.smoke else ""))  # fmt: skip
            text = ("efficiency = (one GPU's fwd+bwd on the whole sequence with the same kernels ÷ W) ÷ fwd+bwd "
                    "(dense rows); visible = the mask's (query, key) pairs over dense causal's, TFLOP/s/GPU counting "
                    "those; documents log-uniform in [doc_min, doc_max] tokens, seed 0; predicted = "
                    "ringflash.plan.predict (default Cluster, the shipped rates of the kernels the backend runs; model "
                    "plan_model), its efficiency the "
                    "planner's one-GPU time ÷ W over its grid time; torch CP efficiency against SDPA with the same "
                    "backend on one GPU. " + " ".join(table.notes))  # fmt: skip
            run_args = {"world": world, "causal": True, "layout": "zigzag",
                        "shapes": {s: shapes_table[s] for s in shapes},
                        "tokens_per_gpu": args.tokens_per_gpu, "total": args.total, "grids": args.grids,
                        "schemes": args.schemes, "heads_k_stride": args.heads_k_stride, "docs": args.docs,
                        "doc_min": args.doc_min, "doc_max": args.doc_max,
                        "backend": args.backend, "iters": args.iters, "warmup": args.warmup, "smoke": args.smoke,
                        "transport": "nccl" if cuda else "gloo", "plan_model": model_version()}  # fmt: skip
            peers = sorted({r[5] for r in table.rows if str(r[5]).startswith("torch CP")})
            record("scaling", title, HEADERS, table.rows, args=run_args, notes=text.strip(), peers=peers,
                   directory=record_to)  # fmt: skip
        dist.barrier()  # tear down together (see bench_ring)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
