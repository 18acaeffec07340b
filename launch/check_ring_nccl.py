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
from dataclasses import dataclass

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
        help="kernel backend (auto: hopper on H100/H200, Triton on other GPUs, the reference on CPU)",
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
    return p.parse_args(argv)


@dataclass
class Check:
    """One run: its arguments, this rank's place in the world and the grid, and the global inputs
    (identical on every rank), with the two things every check does: shard and attend."""

    args: argparse.Namespace
    rank: int
    world: int
    cuda: bool
    dev: torch.device
    transports: tuple[str, ...]
    window_size: tuple[int, int]
    features: bool  # a window, softcapping, a sink or v's own head dim: naive references
    ring_group: dist.ProcessGroup | None
    head_group: dist.ProcessGroup | None
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    sink: torch.Tensor | None

    @property
    def u(self) -> int:
        return self.args.head_parallel

    @property
    def backend(self) -> str:
        return self.args.backend

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.args.dtype]

    def sh(self, x: torch.Tensor, dim: int, layout: str = "zigzag") -> torch.Tensor:
        """This rank's part of a global tensor: the ring's shard, or with u > 1 the grid's piece."""
        if self.u == 1:
            return shard(x, dim, self.rank, self.world, layout)
        r_rank, h_rank = grid_coords(self.rank, self.u)
        return shard(x, dim, r_rank, self.world // self.u, layout, head_rank=h_rank, head_world=self.u)

    def attn(self, q, k, v, plain=False, **kw):
        if self.features and not plain:
            kw.update(window_size=self.window_size, softcap=self.args.softcap, learnable_sink=self.sink)
        if self.args.scheme != "ring":
            kw.pop("transport", None)  # the ring's option, which the all-gather refuses
        return ring_flash_attn_func(
            q, k, v, group=self.ring_group, head_group=self.head_group, scheme=self.args.scheme, **kw
        )


def init_distributed() -> tuple[int, int, bool, int]:
    """(rank, world, cuda, local rank), the process group started: NCCL on GPUs, else gloo."""
    torch.backends.cuda.matmul.allow_tf32 = False  # keep the fp32 reference true fp32
    torch.backends.cudnn.allow_tf32 = False
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", pg_options=nccl_options() if cuda else None)
    return dist.get_rank(), dist.get_world_size(), cuda, local_rank


def refusal(args: argparse.Namespace, world: int, features: bool) -> str | None:
    """Why this grid or size cannot be checked, or None."""
    u = args.head_parallel
    if u < 1 or world % u or args.heads % u:
        return f"--head-parallel {u} must divide the world ({world}) and --heads ({args.heads})"
    if features and world * args.tokens_per_rank > 32768:  # one K/V head's float64 N×N scores and grads
        return (f"--tokens-per-rank {args.tokens_per_rank}: with a window or a feature the naive references "
                f"hold N×N scores; keep N = {world} ranks × tokens per rank ≤ 32768")  # fmt: skip
    return None


def make_inputs(args: argparse.Namespace, world: int, dev: torch.device, dv: int):
    """q, k, v, do (and the sink) on the whole sequence, rank 0's broadcast to all."""
    B, N, H, Hkv, D = args.batch, args.tokens_per_rank * world, args.heads, args.kv_heads, args.head_dim
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    q, do = (torch.randn(B, N, H, d, device=dev, dtype=dtype, generator=gen) for d in (D, dv))
    k, v = (torch.randn(B, N, Hkv, d, device=dev, dtype=dtype, generator=gen) for d in (D, dv))
    sink = torch.randn(H, device=dev, generator=gen) if args.sink else None
    for t in (q, k, v, do) + ((sink,) if args.sink else ()):  # identical inputs on every rank
        dist.broadcast(t, src=0)
    return q, k, v, do, sink


def print_header(c: Check, kernels_name: str) -> None:
    args, (B, N, H, D), Hkv, Dv = c.args, c.q.shape, c.k.shape[2], c.v.shape[-1]
    grid = args.scheme if c.u == 1 else f"hybrid u={c.u} head x r={c.world // c.u} {args.scheme}"
    extras = [f"window_size={c.window_size}"] * (args.window_size is not None)
    extras += [f"softcap={args.softcap}"] * bool(args.softcap) + ["learnable_sink"] * args.sink
    extras += [f"v head dim {Dv}"] * (Dv != D)
    print(
        f"{grid} over {c.world} {dist.get_backend()} ranks: B={B} N={N} ({args.tokens_per_rank}/rank) "
        f"H={H} Hkv={Hkv} "
        f"D={D} {args.dtype}, {kernels_name} kernels" + "".join(f", {x}" for x in extras)
    )
    print(f"{'layout':<11}{'causal':<7}{'tensor':<7}{'err ring':>10}{'err single':>12}{'ratio':>8}  ok")


def references(c: Check, causal: bool) -> tuple[dict, dict]:
    """(single, ref32) on the whole sequence: the naive ones in the inputs' dtype and float64 with
    features, else the same kernels on one device and float32 SDPA."""
    q, k, v, do, backend = c.q, c.k, c.v, c.do, c.backend
    if c.features:
        return (
            naive_attention(q, k, v, do, causal, c.window_size, c.args.softcap, c.sink, c.dtype),
            naive_attention(q, k, v, do, causal, c.window_size, c.args.softcap, c.sink, torch.float64),
        )
    o1, lse1 = attn_fwd(q, k, v, causal=causal, backend=backend)
    dq1, dk1, dv1 = attn_bwd(do, q, k, v, o1, lse1, causal=causal, backend=backend)
    single = {"o": o1, "dq": dq1, "dk": dk1, "dv": dv1, "lse": lse1}
    return single, reference_fp32(q, k, v, do, causal)


def check_sink(c: Check, layout: str, causal: bool, dsink: torch.Tensor, single: dict, ref32: dict) -> int:
    """Failures (0 or 1) of the sink's gradient: each rank's covers its rows, their sum the whole one."""
    c.sink.requires_grad_(False)
    dist.all_reduce(dsink)
    e_sink = rel_err(dsink, ref32["dsink"])
    sink_ok = e_sink <= 2 * rel_err(single["dsink"], ref32["dsink"]) + 1e-4 and e_sink < 3e-2
    if c.rank == 0:
        print(f"{layout:<11}{causal!s:<7}{'dsink':<7}{e_sink:10.2e}  {'ok' if sink_ok else 'FAIL'}")
    return int(not sink_ok)


def check_tensors(c: Check, layout: str, causal: bool, outs: tuple, single: dict, ref32: dict) -> int:
    """Failures among o, dq, dk, dv against the references and lse against single's (ref32's with
    features); rank 0 prints the worst rank's numbers."""
    o, lse, dq, dk, dv = outs
    sh = c.sh
    rows = []
    for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
        e_ring = rel_err(x, sh(ref32[name], 1, layout))
        e_single = rel_err(sh(single[name], 1, layout), sh(ref32[name], 1, layout))
        ok = x.dtype == c.dtype and e_ring <= 2 * e_single + 1e-4 and e_ring < 3e-2
        rows.append((name, e_ring, e_single, ok))
    lse_ref = (ref32 if c.features else single)["lse"].float()  # the naive bf16 lse is no oracle
    d_lse = (lse - sh(lse_ref, 2, layout)).abs().nan_to_num(0.0).max().item()
    lse_ok = d_lse < 1e-3 and torch.equal(torch.isneginf(lse), torch.isneginf(sh(lse_ref, 2, layout)))
    failures = sum(not r[3] for r in rows) + (not lse_ok)
    # Report the worst rank: gather every rank's numbers to rank 0.
    stats = torch.tensor([[r[1], r[2], float(r[3])] for r in rows] + [[d_lse, 0.0, float(lse_ok)]], device=c.dev)
    gathered = [torch.empty_like(stats) for _ in range(c.world)] if c.rank == 0 else None
    dist.gather(stats, gathered, dst=0)
    if c.rank == 0:
        worst = torch.stack(gathered)
        for i, name in enumerate(["o", "dq", "dk", "dv", "lse"]):
            e_r, e_s = worst[:, i, 0].max().item(), worst[:, i, 1].max().item()
            ok = bool(worst[:, i, 2].min().item())
            ratio = f"{e_r / e_s:8.2f}" if name != "lse" else f"{'(abs)':>8}"
            print(f"{layout:<11}{causal!s:<7}{name:<7}{e_r:10.2e}{e_s:12.2e}{ratio}  {'ok' if ok else 'FAIL'}")
    return failures


def check_bit_identity(c: Check, layout: str, causal: bool, outs: tuple, firsts: tuple, compared: int) -> int:
    """Failures (0 or 1): another transport moves the same bytes, so its results must be
    bit-identical (with a backend whose backward is not deterministic, cuDNN's or hopper's, the
    forward's)."""
    equal = all(torch.equal(a, b) for a, b in zip(firsts[:compared], outs))
    same = torch.tensor([equal], device=c.dev, dtype=torch.int32)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if c.rank == 0:
        verdict = "ok" if same.item() else "FAIL"
        what = "" if compared == 5 else " (forward)"
        print(f"{layout:<11}{causal!s:<7}bit-identical to {c.transports[0]}{what}: {verdict}")
    return int(not same.item())


def check_cases(c: Check, cases: list, compared: int) -> int:
    """Failures over every transport × (layout, causal): the ring against the references, and
    each transport after the first against the first."""
    failures = 0
    refs, first = {}, {}
    for transport, (layout, causal) in [(t, case) for t in c.transports for case in cases]:
        if c.rank == 0 and (layout, causal) == cases[0]:
            print(f"-- transport: {transport}")
        if causal not in refs:
            refs[causal] = references(c, causal)
        single, ref32 = refs[causal]
        ql, kl, vl = (c.sh(t, 1, layout).detach().requires_grad_() for t in (c.q, c.k, c.v))
        if c.sink is not None:
            c.sink.requires_grad_()
        o, lse, _ = c.attn(
            ql, kl, vl, causal=causal, layout=layout, return_attn_probs=True, transport=transport, backend=c.backend
        )
        dq, dk, dv, *dsink = torch.autograd.grad(
            o, (ql, kl, vl) + ((c.sink,) if c.sink is not None else ()), c.sh(c.do, 1, layout)
        )
        if c.sink is not None:
            failures += check_sink(c, layout, causal, dsink[0], single, ref32)
        failures += check_tensors(c, layout, causal, (o, lse, dq, dk, dv), single, ref32)
        if (layout, causal) in first:
            failures += check_bit_identity(c, layout, causal, (o, lse, dq, dk, dv), first[layout, causal], compared)
        else:
            first[layout, causal] = (o, lse, dq, dk, dv)
        del o, lse, dq, dk, dv
    return failures


def check_no_host_sync(c: Check) -> int:
    """Failures: neither the ring nor the cross-rank check may block the host (CUDA only)."""
    failures = 0
    for transport in c.transports if c.cuda else ():
        ql, kl, vl = (c.sh(t, 1).detach().requires_grad_() for t in (c.q, c.k, c.v))
        # Once first: a shape's first call compiles and autotunes its kernels, which synchronises.
        o = c.attn(ql, kl, vl, causal=True, transport=transport, backend=c.backend, plain=True)
        torch.autograd.grad(o, (ql, kl, vl), c.sh(c.do, 1))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            o = c.attn(ql, kl, vl, causal=True, transport=transport, backend=c.backend, plain=True)
            torch.autograd.grad(o, (ql, kl, vl), c.sh(c.do, 1))
            sync_msg = "none"
        except RuntimeError as e:
            failures += 1
            sync_msg = f"FAIL: {str(e).splitlines()[0]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        if c.rank == 0:
            print(f"host synchronisations in a ring call with the cross-rank check ({transport}): {sync_msg}")
    return failures


def check_disagreements(c: Check) -> int:
    """Failures: ranks that disagree all raise, naming the field, and nothing is left in flight:
    the group still runs a correct call afterwards. Rank 0 passes half its tokens, or (CUDA)
    moves its blocks by copy engine while rank 1 uses NCCL."""
    failures = 0
    ql, kl, vl = (c.sh(t, 1) for t in (c.q, c.k, c.v))
    half = ql.shape[1] // 2 if c.rank == 0 else ql.shape[1]
    disagreements = [("q.shape", half, "nccl")]
    if c.cuda and c.u == 1 and c.args.scheme == "ring":  # hybrid: ranks 0 and 1 in different rings (docstring)
        disagreements.append(("transport", ql.shape[1], "copy-engine" if c.rank == 0 else "nccl"))
    o_causal = attn_fwd(c.q, c.k, c.v, causal=True, backend=c.backend)[0]
    for field, cut, transport in disagreements:
        try:
            c.attn(
                ql[:, :cut], kl[:, :cut], vl[:, :cut], causal=True, transport=transport, backend=c.backend, plain=True
            )
            mismatch_msg, mismatch_ok = "no error", False
        except ValueError as e:
            mismatch_msg = str(e)
            mismatch_ok = f"{field} is" in mismatch_msg or (c.u > 1 and "rejected their inputs" in mismatch_msg)
        o = c.attn(ql, kl, vl, causal=True, backend=c.backend, plain=True)
        mismatch_ok = mismatch_ok and rel_err(o, c.sh(o_causal, 1)) < 3e-2
        failures += not mismatch_ok
        if c.rank == 0:
            print(f"ranks with different {field}: {'ok' if mismatch_ok else 'FAIL'} ({mismatch_msg[:140]})")
    return failures


def main() -> int:
    args = parse_args()
    window_size = tuple(int(x) for x in args.window_size.split(",")) if args.window_size else (-1, -1)
    Dv = args.v_head_dim or args.head_dim
    features = args.window_size is not None or args.softcap or args.sink or Dv != args.head_dim

    rank, world, cuda, local_rank = init_distributed()
    transports = TRANSPORTS if cuda and args.scheme == "ring" else ("nccl",)  # copy engines need GPUs
    if args.transports:
        transports = tuple(args.transports.split(","))
    why = refusal(args, world, features)
    if why:
        if rank == 0:
            print(why)
        dist.destroy_process_group()
        return 2
    u = args.head_parallel
    ring_group, head_group = hybrid_groups(u) if u > 1 else (None, None)

    failures = 0
    try:
        dev = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        kernels_used = get_backend(args.backend, dev)
        # Bit-identity across transports: all five results, or with a backend whose backward is not
        # deterministic (cuDNN's, hopper's) the forward's two.
        compared = 5 if kernels_used.deterministic else 2
        c = Check(args, rank, world, cuda, dev, transports, window_size, bool(features), ring_group, head_group,
                  *make_inputs(args, world, dev, Dv))  # fmt: skip
        # A window's right side needs causal off; with causal a (left, 0) window.
        cases = [case for case in CASES if case[1] == (window_size[1] <= 0)] if args.window_size else CASES
        if rank == 0:
            print_header(c, kernels_used.name)
        failures += check_cases(c, cases, compared)
        failures += check_no_host_sync(c)
        failures += check_disagreements(c)
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
