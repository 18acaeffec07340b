"""Exactness of ring attention over NCCL at scale: one GPU per rank, Triton kernels, bf16.

    torchrun --standalone --nproc_per_node=2 launch/check_ring_nccl.py [--tokens-per-rank 65536]
    torchrun --standalone --nproc_per_node=2 launch/check_ring_nccl.py --backend cudnn
    torchrun --standalone --nproc_per_node=8 launch/check_ring_nccl.py --head-parallel 2   # hybrid: u=2 × r=4
    torchrun --standalone --nproc_per_node=4 launch/check_ring_nccl.py --scheme allgather --window-size 1000,0
    torchrun --standalone --nproc_per_node=4 launch/check_ring_nccl.py --tokens-per-rank 2048 --softcap 30 --sink

--scheme allgather: the all-gather scheme (ringflash/allgather.py) instead of the ring, alone or with
--head-parallel; it has no transports of its own, so only the NCCL group runs it.
--window-size L,R, --softcap C, --sink (a random float32 logit per head), --v-head-dim: the features,
checked against a naive float64 implementation on the whole sequence (`ref32` then means float64),
with `single` a naive implementation in the inputs' dtype (flash_attn's criterion); the sink's
gradient, summed over the ranks, against the float64 one. The naive implementations hold one
K/V head's N×N scores at a time: keep N = world × tokens per rank to some 16k.

--head-parallel U (default 1, the ring alone): the head-parallel × ring hybrid (ringflash/hybrid.py)
on a grid of U head ranks × r = world/U ring ranks, groups from `ringflash.hybrid_groups(U)`,
inputs sharded by `shard(..., ring_rank, r, layout, head_rank=, head_world=U)` and passed with
`group=ring_group, head_group=head_group`; U = world is pure head parallelism (a ring of one).
The same checks against the same one-device references; the transports are the ring's (the
head all-to-all is always the group's own). The disagreeing-transport check is the ring's only
(with U > 1 ranks 0 and 1 sit in different rings, where transports need not agree); for the
disagreeing-shape check, ranks outside rank 0's head group report "rank(s) ... rejected their
inputs" rather than the field, which also passes.

Every rank builds the same global q, k, v, do (generated on rank 0, broadcast), runs the ring on
its shard, and compares its shard of o, lse, dq, dk, dv with
- the same kernels (Triton, or `--backend cudnn` / `hopper`) run on the whole sequence on one GPU (`single`), and
- float32 SDPA (memory-efficient backend, true fp32) on the whole sequence (`ref32`).
A float64 ground truth at 128k tokens does not fit; float32 is 2^16 times more precise than
bf16, so it stands in for it.

Pass criteria (per tensor, relative Frobenius error on this rank's shard):
    err(ring, ref32) <= 2 · err(single, ref32) + 1e-4   and   err(ring, ref32) < 3e-2 (bf16 tolerance)
    max |lse_ring − lse_single| < 1e-3 (both float32; they differ only by summation order)
    no host synchronisation in a ring call (CUDA only), the cross-rank check included: one more
    fwd+bwd under torch.cuda.set_sync_debug_mode("error")
    ranks given different shapes (or, with CUDA, transports) all raise ValueError naming the
    field, and the next call is right
    with CUDA, all of it for each transport (ringflash.transport.TRANSPORTS: NCCL, copy engine), and
    the copy engine's results bit-identical to NCCL's (with cuDNN, whose backward is not
    deterministic, its forward's)
Exits non-zero on every rank if any check fails on any rank. Only rank 0 prints.
Without CUDA it runs on CPU over gloo with the reference kernels: a smoke test of the script
itself (`--tokens-per-rank 64 --head-dim 32`), not of NCCL.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ringflash import grid_coords, hybrid_groups, nccl_options, ring_flash_attn_func, shard
from ringflash.bench import exit_without_teardown
from ringflash.kernels import attn_bwd, attn_fwd, get_backend
from ringflash.transport import TRANSPORTS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CASES = (("zigzag", True), ("contiguous", True), ("zigzag", False))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float("inf") if not torch.isfinite(x).all() else ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def reference_fp32(q, k, v, do, causal):
    """float32 SDPA on the whole sequence: o, dq, dk, dv in (B, N, heads, D) layout."""
    g = q.shape[2] // k.shape[2]
    q32, k32, v32 = (t.float().transpose(1, 2).requires_grad_() for t in (q, k, v))
    kr, vr = k32.repeat_interleave(g, dim=1), v32.repeat_interleave(g, dim=1)  # GQA by repetition
    # Memory-efficient: O(N) memory in true fp32 on CUDA; math on CPU (smoke runs only).
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        o = F.scaled_dot_product_attention(q32, kr, vr, is_causal=causal)
    dq, dk, dv = torch.autograd.grad(o, (q32, k32, v32), do.float().transpose(1, 2))
    return {n: t.transpose(1, 2).detach() for n, t in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv))}


def naive_attention(q, k, v, do, causal, window_size, softcap, sink, dtype):
    """Attention on the whole sequence in `dtype`, one K/V head at a time (O(N²) memory per head):
    o, dq, dk, dv in `(B, N, heads, D)`, lse `(B, H, N)` (the sink included) and dsink."""
    N, g, Hkv = q.shape[1], q.shape[2] // k.shape[2], k.shape[2]
    i = torch.arange(N, device=q.device)
    visible = i[None, :] <= i[:, None] if causal else torch.ones(N, N, dtype=torch.bool, device=q.device)
    left, right = window_size
    if left >= 0:
        visible &= i[None, :] >= i[:, None] - left
    if right >= 0:
        visible &= i[None, :] <= i[:, None] + right
    outs = {n: [] for n in ("o", "dq", "dk", "dv", "lse", "dsink")}
    for j in range(Hkv):
        heads = slice(j * g, (j + 1) * g)
        qj, kj, vj = (
            t.to(dtype).transpose(1, 2).detach().requires_grad_()
            for t in (q[:, :, heads], k[:, :, j : j + 1], v[:, :, j : j + 1])
        )
        sj = None if sink is None else sink[heads].to(dtype).detach().requires_grad_()
        s = qj @ kj.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, g, N, N)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~visible, float("-inf"))
        if sj is not None:  # one more logit per head, with a zero value
            s = torch.cat([s, sj.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
        lse = torch.logsumexp(s.float(), dim=-1)
        p = torch.softmax(s.float(), dim=-1).to(dtype)
        o = p[..., :N] @ vj
        grads = torch.autograd.grad(
            o, (qj, kj, vj) + ((sj,) if sj is not None else ()), do[:, :, heads].to(dtype).transpose(1, 2)
        )
        for name, t in zip(("o", "dq", "dk", "dv"), (o, *grads[:3])):
            outs[name].append(t.transpose(1, 2).detach())
        outs["lse"].append(lse.detach())
        outs["dsink"].append(grads[3] if sj is not None else torch.zeros(g, device=q.device))
    res = {n: torch.cat(outs[n], dim=2) for n in ("o", "dq", "dk", "dv")}
    res["lse"] = torch.cat(outs["lse"], dim=1)
    res["dsink"] = torch.cat(outs["dsink"])
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-rank", type=int, default=65536)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--v-head-dim", type=int, default=None,
                   help="v's head dim (DeepSeek's MLA: 192 for q/k, 128 for v); checked against the naive references")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--backend",
        choices=("auto", "triton", "cudnn", "hopper"),
        default="auto",
        help="kernel backend (auto: Triton on CUDA, the reference on CPU)",
    )
    p.add_argument(
        "--head-parallel",
        type=int,
        default=1,
        metavar="U",
        help="head ranks of the hybrid grid (U x world/U); 1: the ring alone",
    )
    p.add_argument(
        "--transports", default=None, help="comma-separated ring transports (default: all on CUDA, nccl on CPU)"
    )
    p.add_argument("--scheme", choices=("ring", "allgather"), default="ring")
    p.add_argument(
        "--window-size",
        default=None,
        metavar="L,R",
        help="flash_attn's window_size (with causal, R must be 0); checked against a naive reference",
    )
    p.add_argument("--softcap", type=float, default=0.0, help="logit softcapping c (0: none)")
    p.add_argument("--sink", action="store_true", help="a random learnable sink per query head")
    args = p.parse_args()
    window_size = tuple(int(x) for x in args.window_size.split(",")) if args.window_size else (-1, -1)
    Dv = args.v_head_dim or args.head_dim
    features = args.window_size is not None or args.softcap or args.sink or Dv != args.head_dim
    backend = args.backend

    torch.backends.cuda.matmul.allow_tf32 = False  # keep the fp32 reference true fp32
    torch.backends.cudnn.allow_tf32 = False
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", pg_options=nccl_options() if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    transports = TRANSPORTS if cuda and args.scheme == "ring" else ("nccl",)  # copy engines need GPUs
    if args.transports:
        transports = tuple(args.transports.split(","))
    u = args.head_parallel
    if u < 1 or world % u or args.heads % u:
        if rank == 0:
            print(f"--head-parallel {u} must divide the world ({world}) and --heads ({args.heads})")
        dist.destroy_process_group()
        return 2
    if features and world * args.tokens_per_rank > 32768:  # one K/V head's float64 N×N scores and grads
        if rank == 0:
            print(f"--tokens-per-rank {args.tokens_per_rank}: with a window or a feature the naive references "
                  f"hold N×N scores; keep N = {world} ranks × tokens per rank ≤ 32768")
        dist.destroy_process_group()
        return 2
    # Ring rank and ring size of this rank (the whole world when u = 1), and the hybrid's groups.
    r_rank, h_rank = grid_coords(rank, u)
    r_world = world // u
    ring_group, head_group = hybrid_groups(u) if u > 1 else (None, None)

    def sh(x: torch.Tensor, dim: int, layout: str = "zigzag") -> torch.Tensor:
        """This rank's part of a global tensor: the ring's shard, or with u > 1 the grid's piece."""
        if u == 1:
            return shard(x, dim, rank, world, layout)
        return shard(x, dim, r_rank, r_world, layout, head_rank=h_rank, head_world=u)

    def attn(q, k, v, plain=False, **kw):
        if features and not plain:
            kw.update(window_size=window_size, softcap=args.softcap, learnable_sink=sink)
        if args.scheme != "ring":
            kw.pop("transport", None)  # the ring's option, which the all-gather refuses
        return ring_flash_attn_func(q, k, v, group=ring_group, head_group=head_group, scheme=args.scheme, **kw)

    failures = 0
    try:
        B, N, H, Hkv, D = args.batch, args.tokens_per_rank * world, args.heads, args.kv_heads, args.head_dim
        dtype, dev = DTYPES[args.dtype], torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        kernels_used = get_backend(backend, dev)
        # Bit-identity across transports: all five results, or with a backend whose backward is not
        # deterministic (cuDNN's, hopper's) the forward's two.
        compared = 5 if kernels_used.deterministic else 2
        gen = torch.Generator(device=dev).manual_seed(args.seed)
        q, do = (torch.randn(B, N, H, d, device=dev, dtype=dtype, generator=gen) for d in (D, Dv))
        k, v = (torch.randn(B, N, Hkv, d, device=dev, dtype=dtype, generator=gen) for d in (D, Dv))
        sink = torch.randn(H, device=dev, generator=gen) if args.sink else None
        for t in (q, k, v, do) + ((sink,) if args.sink else ()):  # identical inputs on every rank
            dist.broadcast(t, src=0)
        # A window's right side needs causal off; with causal a (left, 0) window.
        cases = [c for c in CASES if c[1] == (window_size[1] <= 0)] if args.window_size else CASES
        if rank == 0:
            grid = args.scheme if u == 1 else f"hybrid u={u} head x r={r_world} {args.scheme}"
            extras = [f"window_size={window_size}"] * (args.window_size is not None)
            extras += [f"softcap={args.softcap}"] * bool(args.softcap) + ["learnable_sink"] * args.sink
            extras += [f"v head dim {Dv}"] * (Dv != D)
            print(
                f"{grid} over {world} {dist.get_backend()} ranks: B={B} N={N} ({args.tokens_per_rank}/rank) "
                f"H={H} Hkv={Hkv} "
                f"D={D} {args.dtype}, {kernels_used.name} kernels" + "".join(f", {x}" for x in extras)
            )
            print(f"{'layout':<11}{'causal':<7}{'tensor':<7}{'err ring':>10}{'err single':>12}{'ratio':>8}  ok")
        refs, first = {}, {}
        for transport, (layout, causal) in [(t, c) for t in transports for c in cases]:
            if rank == 0 and (layout, causal) == cases[0]:
                print(f"-- transport: {transport}")
            if causal not in refs and features:
                refs[causal] = (
                    naive_attention(q, k, v, do, causal, window_size, args.softcap, sink, dtype),
                    naive_attention(q, k, v, do, causal, window_size, args.softcap, sink, torch.float64),
                )
            elif causal not in refs:
                o1, lse1 = attn_fwd(q, k, v, causal=causal, backend=backend)
                dq1, dk1, dv1 = attn_bwd(do, q, k, v, o1, lse1, causal=causal, backend=backend)
                single = {"o": o1, "dq": dq1, "dk": dk1, "dv": dv1, "lse": lse1}
                refs[causal] = (single, reference_fp32(q, k, v, do, causal))
            single, ref32 = refs[causal]
            ql, kl, vl = (sh(t, 1, layout).detach().requires_grad_() for t in (q, k, v))
            if sink is not None:
                sink.requires_grad_()
            o, lse, _ = attn(
                ql, kl, vl, causal=causal, layout=layout, return_attn_probs=True, transport=transport, backend=backend
            )
            dq, dk, dv, *dsink = torch.autograd.grad(
                o, (ql, kl, vl) + ((sink,) if sink is not None else ()), sh(do, 1, layout)
            )
            if sink is not None:  # each rank's gradient covers its rows: their sum is the whole one
                sink.requires_grad_(False)
                dist.all_reduce(dsink[0])
                e_sink = rel_err(dsink[0], ref32["dsink"])
                sink_ok = e_sink <= 2 * rel_err(single["dsink"], ref32["dsink"]) + 1e-4 and e_sink < 3e-2
                failures += not sink_ok
                if rank == 0:
                    print(f"{layout:<11}{causal!s:<7}{'dsink':<7}{e_sink:10.2e}  {'ok' if sink_ok else 'FAIL'}")
            rows = []
            for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
                e_ring = rel_err(x, sh(ref32[name], 1, layout))
                e_single = rel_err(sh(single[name], 1, layout), sh(ref32[name], 1, layout))
                ok = x.dtype == dtype and e_ring <= 2 * e_single + 1e-4 and e_ring < 3e-2
                rows.append((name, e_ring, e_single, ok))
            lse_ref = (ref32 if features else single)["lse"].float()  # the naive bf16 lse is no oracle
            d_lse = (lse - sh(lse_ref, 2, layout)).abs().nan_to_num(0.0).max().item()
            lse_ok = d_lse < 1e-3 and torch.equal(torch.isneginf(lse), torch.isneginf(sh(lse_ref, 2, layout)))
            failures += sum(not r[3] for r in rows) + (not lse_ok)
            # Report the worst rank: gather every rank's numbers to rank 0.
            stats = torch.tensor([[r[1], r[2], float(r[3])] for r in rows] + [[d_lse, 0.0, float(lse_ok)]], device=dev)
            gathered = [torch.empty_like(stats) for _ in range(world)] if rank == 0 else None
            dist.gather(stats, gathered, dst=0)
            if rank == 0:
                worst = torch.stack(gathered)
                for i, name in enumerate(["o", "dq", "dk", "dv", "lse"]):
                    e_r, e_s = worst[:, i, 0].max().item(), worst[:, i, 1].max().item()
                    ok = bool(worst[:, i, 2].min().item())
                    ratio = f"{e_r / e_s:8.2f}" if name != "lse" else f"{'(abs)':>8}"
                    print(f"{layout:<11}{causal!s:<7}{name:<7}{e_r:10.2e}{e_s:12.2e}{ratio}  {'ok' if ok else 'FAIL'}")
            # Another transport moves the same bytes: its results must be bit-identical (with a
            # backend whose backward is not deterministic, cuDNN's or hopper's, the forward's).
            if (layout, causal) in first:
                equal = all(torch.equal(a, b) for a, b in zip(first[layout, causal][:compared], (o, lse, dq, dk, dv)))
                same = torch.tensor([equal], device=dev, dtype=torch.int32)
                dist.all_reduce(same, op=dist.ReduceOp.MIN)
                failures += not same.item()
                if rank == 0:
                    verdict = "ok" if same.item() else "FAIL"
                    what = "" if compared == 5 else " (forward)"
                    print(f"{layout:<11}{causal!s:<7}bit-identical to {transports[0]}{what}: {verdict}")
            else:
                first[layout, causal] = (o, lse, dq, dk, dv)
            del o, lse, dq, dk, dv
        first.clear()
        for transport in transports if cuda else ():  # neither the ring nor the cross-rank check may block the host
            ql, kl, vl = (sh(t, 1).detach().requires_grad_() for t in (q, k, v))
            # Once first: a shape's first call compiles and autotunes its kernels, which synchronises.
            o = attn(ql, kl, vl, causal=True, transport=transport, backend=backend, plain=True)
            torch.autograd.grad(o, (ql, kl, vl), sh(do, 1))
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                o = attn(ql, kl, vl, causal=True, transport=transport, backend=backend, plain=True)
                torch.autograd.grad(o, (ql, kl, vl), sh(do, 1))
                sync_msg = "none"
            except RuntimeError as e:
                failures += 1
                sync_msg = f"FAIL: {str(e).splitlines()[0]}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            if rank == 0:
                print(f"host synchronisations in a ring call with the cross-rank check ({transport}): {sync_msg}")
        # Ranks that disagree all raise, naming the field, and nothing is left in flight: the group
        # still runs a correct call afterwards. Rank 0 passes half its tokens, or (CUDA) moves its
        # blocks by copy engine while rank 1 uses NCCL.
        ql, kl, vl = (sh(t, 1) for t in (q, k, v))
        half = ql.shape[1] // 2 if rank == 0 else ql.shape[1]
        disagreements = [("q.shape", half, "nccl")]
        if cuda and u == 1 and args.scheme == "ring":  # hybrid: ranks 0 and 1 in different rings (docstring)
            disagreements.append(("transport", ql.shape[1], "copy-engine" if rank == 0 else "nccl"))
        o_causal = attn_fwd(q, k, v, causal=True, backend=backend)[0]
        for field, cut, transport in disagreements:
            try:
                attn(
                    ql[:, :cut], kl[:, :cut], vl[:, :cut], causal=True, transport=transport, backend=backend, plain=True
                )
                mismatch_msg, mismatch_ok = "no error", False
            except ValueError as e:
                mismatch_msg = str(e)
                mismatch_ok = f"{field} is" in mismatch_msg or (u > 1 and "rejected their inputs" in mismatch_msg)
            o = attn(ql, kl, vl, causal=True, backend=backend, plain=True)
            mismatch_ok = mismatch_ok and rel_err(o, sh(o_causal, 1)) < 3e-2
            failures += not mismatch_ok
            if rank == 0:
                print(f"ranks with different {field}: {'ok' if mismatch_ok else 'FAIL'} ({mismatch_msg[:140]})")
        total = torch.tensor([failures], device=dev)
        dist.all_reduce(total)
        failures = int(total.item())
        if rank == 0:
            print("PASS" if failures == 0 else f"FAIL: {failures} check(s) failed")
        dist.barrier()  # tear down together, as bench_ring does (a gloo rank may abort at exit otherwise)
    finally:
        dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    exit_without_teardown(main())
