"""Which context-parallel layout to run: an analytic cost model of one attention layer.

    python -m ringflash.plan --heads 32 --kv-heads 8 --head-dim 128 --layers 32 \\
        --seqlen 1M --gpus 128                       # or --gpus-per-node 8 --nodes 16
    python -m ringflash.plan_validation            # predicted vs measured, benchmarks/ring.jsonl, scaling.jsonl
    best, why = choose_layout(Model(32, 8, 128), 32768, cluster_of(4, 8))   # in Python: 4 of 8 GPUs per node

For a grid of `u` head-parallel × `r` context-parallel ranks (ringflash/hybrid.py; r = 1 pure
head parallelism) and a scheme across the r ranks (`ring`, K/V passed around; `allgather`, K/V
all-gathered in chunks of `heads_k_stride` heads), the forward + backward time of one layer is
the sum of:
- **ring steps**: step s computes its block pair (the layout's schedule: zigzag's half blocks,
  contiguous's full block on the critical rank, the causal diagonal at step 0) while the next
  K/V block travels, so a step costs max(compute, transfer) + a fixed per-step overhead. In the
  backward each block's float32 dK/dV sums travel on to the next rank too, and can leave only
  once the step's dK/dV are complete: after the dK/dV kernel of a split backward (Triton's, which
  adds the arriving sums in its epilogue: the dQ kernel hides the hop), after all of a fused one
  (`hopper`, `cudnn`), which adds the arriving sums in a pass after its kernel (`hbm_gbs`): the
  hop travels during the next step's kernel. The last step's sums are the rank's own: no hop
  follows it. A ring hop's rate depends on the transport: NCCL send/recv (`nccl_p2p_gbs`, or
  `nccl_pair_gbs` between two ranks), the copy engine (`copy_engine_gbs`), InfiniBand across
  nodes.
- **all-gather chunks**: chunk i computes this rank's queries against all keys (the layout
  balances any mask exactly: 1/r of the work) while chunk i + 1's K/V are gathered, and in the
  backward while chunk i − 1's float32 dK/dV are reduce-scattered; the first gather and the last
  reduce-scatter are exposed; a fixed overhead per chunk and direction.
- **all-to-alls** (u > 1): q, k, v to heads and o back (forward), dO to heads and dq, dk, dv
  back (backward), exposed (nothing overlaps them); over NVLink when the head group fits in a
  node (heads are the inner grid dimension), else partly over InfiniBand.
Compute = FLOPs / the rate recorded in benchmarks/kernels.jsonl at the block's length and head dim
for the kernels that run the step: the backend's own where its `supports` takes the step's mask,
else the Triton kernels it falls back to (ringflash/kernel_rates.py); NCCL's kernels take SMs from attention
(`nccl_sm_slowdown`), copy engines do not. Links are NVLink when the whole grid is one node, else
InfiniBand.
Memory: the bytes per GPU one attention call holds beyond its inputs and outputs (K/V blocks in
flight and float32 dK/dV for the ring, gathered chunks and their float32 gradients for the
all-gather, head-layout copies for u > 1); the recommendation is the fastest layout within
`Cluster.memory_gib`. Efficiency = the unsharded attention's FLOPs / (GPUs · time · the
kernel's best recorded rate). Not modelled: the host's launch lead, congestion between
concurrent collectives.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field
from typing import get_args

from ringflash.hybrid import kv_heads_per_rank
from ringflash.kernel_rates import BACKEND_IMPLS, BWD_FLOPS, KernelRates, kernels_that_run
from ringflash.kernels.spec import Kind

__all__ = [
    "Cluster",
    "KernelRates",
    "Model",
    "Prediction",
    "choose_layout",
    "cluster_of",
    "feasible",
    "model_version",
    "plan",
    "predict",
    "recommend",
    "step_kind",
]


@dataclass(frozen=True)
class Model:
    """One attention layer's shape: heads, K/V heads (GQA), head dim, layers, batch, causal, bytes per element."""

    heads: int
    kv_heads: int
    head_dim: int
    layers: int = 1
    batch: int = 1
    causal: bool = True
    dtype_bytes: int = 2


def _option(default, help: str):
    """A `Cluster` field; `help` is what `python -m ringflash.plan --help` says of its option."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Cluster:
    """GPUs and links. Bandwidths in GB/s per GPU, one direction; latencies in µs.

    Defaults: H100/H200 SXM nodes: NVLink 4 at 900 GB/s both ways (450 one way), of which NCCL's
    collectives reach ~80%, its send/recv in a ring of 4 only ~35% (`nccl_p2p_gbs`) and copy
    engines ~75%; one 400 Gb/s InfiniBand NIC per GPU (50 GB/s, ~85% reached); latencies of a
    small NCCL message; `step_overhead_us`: per ring step or all-gather chunk and direction;
    `nccl_sm_slowdown`: attention's slowdown while an NCCL transfer kernel holds SMs.
    """

    gpus_per_node: int = _option(8, "GPUs of one node (NVLink between them)")
    nodes: int = _option(1, "nodes (InfiniBand between them)")
    nvlink_gbs: float = _option(360.0, "NVLink GB/s per GPU, one direction, as NCCL's collectives reach (the "
                              "all-gather, the all-to-alls)")  # fmt: skip
    nccl_p2p_gbs: float = _option(155.0, "GB/s of a ring hop over NCCL send/recv inside a node, each rank "
                                "sending to one peer and receiving from another (as measured on H100s: "
                                "docs/planner.md)")  # fmt: skip
    nccl_pair_gbs: float = _option(280.0, "GB/s of a ring hop over NCCL between two ranks of a node, each sending to "
                                 "the other (as measured on H200s: docs/planner.md)")  # fmt: skip
    copy_engine_gbs: float = _option(335.0, "GB/s of a ring hop by copy engines inside a node (as measured on "
                                   "H100s: docs/planner.md)")  # fmt: skip
    ib_gbs: float = _option(42.0, "InfiniBand GB/s per GPU, one direction, as NCCL reaches")
    hbm_gbs: float = _option(3000.0, "GB/s of an elementwise pass over GPU memory (the fused backwards' dK/dV "
                           "sums; H100 SXM's HBM3: 3350 peak)")  # fmt: skip
    nvlink_lat_us: float = _option(10.0, "latency of a small NCCL message over NVLink, µs")
    ib_lat_us: float = _option(20.0, "latency of a small NCCL message over InfiniBand, µs")
    a2a_efficiency: float = _option(0.8, "all-to-all bandwidth / point-to-point bandwidth (NCCL's, on NVLink)")
    step_overhead_us: float = _option(60.0, "µs per direction of each ring step or all-gather chunk (launches, waits)")
    nccl_sm_slowdown: float = _option(0.05, "attention's slowdown while an NCCL transfer kernel holds SMs")
    memory_gib: float = _option(8.0, "GiB per GPU an attention call's buffers may take beyond its inputs and "
                              "outputs (the rest holds weights and activations); the recommendation keeps "
                              "within it")  # fmt: skip

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Prediction:
    u: int
    r: int
    transport: str
    layout: str
    compute_s: float  # kernel time on the critical rank (fwd + bwd), no communication
    ring_s: float  # the scheme's part across the r ranks, transfers overlapped (fwd + bwd), compute included
    a2a_s: float  # the head all-to-alls, exposed
    time_s: float  # one layer, fwd + bwd
    efficiency: float
    scheme: str = "ring"
    memory_bytes: float = 0.0  # per GPU, beyond the call's inputs and outputs (module docstring)
    serial_s: float = 0.0  # the same work with nothing overlapped: compute, every transfer, overheads
    kernels: str = "triton"  # whose rates (`BACKEND_IMPLS`); "" for rates given as a table

    def describe(self) -> str:
        """The layout in one phrase: `allgather`, `ring (copy-engine)`, `head-parallel u=8`, `ring, u=2 × r=4`."""
        across = self.scheme + (f" ({self.transport})" if self.scheme == "ring" and self.transport != "nccl" else "")
        if self.r == 1:
            return f"head-parallel u={self.u}"
        return across if self.u == 1 else f"{across}, u={self.u} × r={self.r}"


def _flops(m: Model, h: int, nq: float, nk: float, causal_diag: bool) -> float:
    f = 4.0 * m.batch * h * m.head_dim * nq * nk
    return f / 2 if causal_diag else f


def _steps(m: Model, r: int, n: float, layout: str) -> list[tuple[float, float, bool]]:
    """(query rows, key rows, causal) of the critical rank's block pair at each ring step."""
    if not m.causal:
        return [(n, n, False)] * r
    if layout == "zigzag":
        return [(n, n, True)] + [(n, n / 2, False)] * (r - 1)  # half a block pair at every later step
    return [(n, n, True)] + [(n, n, False)] * (r - 1)  # contiguous: the last rank sees every block whole


def _ring(m, rates, c, h, hkv, n, r, layout, slow, bw, lat) -> tuple[float, float]:
    """(compute, time, time with nothing overlapped) of the ring's r steps, forward and backward
    (module docstring)."""
    kv_hop = lat + 2 * m.batch * n * hkv * m.head_dim * m.dtype_bytes / bw
    dkv_hop = lat + 2 * m.batch * n * hkv * m.head_dim * 4 / bw  # the float32 sums
    overhead = c.step_overhead_us * 1e-6 if r > 1 else 0.0
    compute = ring = serial = 0.0
    for direction, flops_x in (("fwd", 1.0), ("bwd", BWD_FLOPS)):
        for s, (nq, nk, causal) in enumerate(_steps(m, r, n, layout)):
            rate = rates.rate(m.head_dim, math.sqrt(nq * nk), causal, direction) * 1e12
            t = flops_x * _flops(m, h, nq, nk, causal) / rate
            compute += t
            serial += t + overhead + (0.0 if s == r - 1 else kv_hop + (dkv_hop if direction == "bwd" else 0.0))
            if direction == "bwd" and rates.late_add and s > 0:
                # The sums that left the previous rank when this step began travel during its kernel;
                # then one pass reads them and this block's dK/dV and writes them (float32, key rows).
                add = 3 * 2 * m.batch * nk * hkv * m.head_dim * 4 / (c.hbm_gbs * 1e9)
                serial += add
                step = (max(t, dkv_hop) if s == r - 1 else max(t * slow, kv_hop + dkv_hop)) + add
            elif s == r - 1:
                step = t  # nothing travels after the last step
            elif direction == "fwd" or rates.late_add:
                step = max(t * slow, kv_hop)
            else:  # the next block's K/V from the start; the sums once dK/dV are complete
                step = max(t * slow, rates.dkdv_share * t * slow + dkv_hop, kv_hop + dkv_hop)
            ring += step + overhead
    return compute, ring, serial


def _allgather(m, rates, c, h, hkv, n, r, stride, slow, bw, lat) -> tuple[float, float]:
    """(compute, time, time with nothing overlapped) of the all-gather's chunks, forward and
    backward (module docstring)."""
    n_global = n * r
    chunks = [min(stride, hkv - i) for i in range(0, hkv, stride)]  # K/V heads per chunk
    per_head = m.batch * n * m.head_dim * (r - 1)  # elements of one K/V head arriving from the other ranks
    # This rank's rows see 1/r of the whole sequence's visible pairs (the layout balances any mask),
    # in one kernel call over all N keys: its tiles are the whole causal problem's, rows cut r ways.
    pairs = n_global * n_global / (2 if m.causal else 1) / r
    compute = total = serial = 0.0
    for direction, flops_x in (("fwd", 1.0), ("bwd", BWD_FLOPS)):
        rate = rates.rate(m.head_dim, n_global, m.causal, direction) * 1e12
        ts = [flops_x * 4.0 * m.batch * s * (h // hkv) * m.head_dim * pairs / rate for s in chunks]
        gathers = [lat + 2 * per_head * s * m.dtype_bytes / bw for s in chunks]
        scatters = [lat + 2 * per_head * s * 4 / bw if direction == "bwd" else 0.0 for s in chunks]
        compute += sum(ts)
        total += gathers[0] + scatters[-1] + len(chunks) * c.step_overhead_us * 1e-6
        serial += sum(ts) + sum(gathers) + sum(scatters) + len(chunks) * c.step_overhead_us * 1e-6
        for i, t in enumerate(ts):  # the next gather and the previous reduce-scatter share the link
            comm = (gathers[i + 1] if i + 1 < len(ts) else 0.0) + (scatters[i - 1] if i else 0.0)
            total += max(t * slow, comm) if comm else t
    return compute, total, serial


def _a2a(m, c, hkv, seqlen, u, r) -> float:
    """The head all-to-alls' exposed time (u > 1)."""
    if u == 1:
        return 0.0
    a2a = 0.0
    n_loc = seqlen / (u * r)
    elems = m.batch * n_loc * m.head_dim * m.dtype_bytes * (u - 1) / u  # bytes per head sent away
    calls = [m.heads + 2 * hkv * u, m.heads, m.heads, m.heads + 2 * hkv * u]  # qkv, o; do, dqkv
    intra = min(u, c.gpus_per_node) / u  # share of peers inside the node (heads are the inner dim)
    for heads in calls:
        b = elems * heads
        t_nvl = b * intra / (c.nvlink_gbs * c.a2a_efficiency * 1e9)
        t_ib = b * (1 - intra) / (c.ib_gbs * c.a2a_efficiency * 1e9) if intra < 1 else 0.0
        a2a += max(t_nvl, t_ib) + (c.nvlink_lat_us if intra == 1 else c.ib_lat_us) * 1e-6
    return a2a


def memory_bytes(m: Model, seqlen: int, u: int, r: int, scheme: str = "ring", heads_k_stride: int = 1) -> float:
    """Bytes per GPU one attention call holds beyond its inputs and outputs, at its peak (the backward).

    Ring (r > 1), per token of the n = N/r ring shard: K/V blocks in flight (two at most), the
    float32 dK/dV sums computed and travelling, the float32 output/dQ accumulators, the bf16
    partial output and the packed K/V sent (docs/memory.md's ring term). All-gather: per chunk of
    s K/V heads, two gathered chunks and the global-order copy of one (bf16), and the float32
    dK/dV of the whole sequence three times (the kernel's, stacked, cut per rank). u > 1: the
    head-layout copies of q, k, v, o and their gradients."""
    h, hkv = m.heads // u, kv_heads_per_rank(m.heads, m.kv_heads, u)
    n, d, b = m.batch * seqlen / r, m.head_dim, m.dtype_bytes
    out = 2 * n * (2 * h + 2 * hkv) * d * b if u > 1 else 0.0
    if r == 1:
        return out
    if scheme == "ring":
        kv_block = 2 * hkv * d * b
        return out + n * (min(2, r - 1) * kv_block + 2 * (2 * hkv * d * 4) + 4 * h * d + b * h * d + kv_block)
    s = min(heads_k_stride, hkv)
    return out + 2 * (n * r) * s * d * (3 * b + 3 * 4)


MASK_KINDS = get_args(Kind)  # what `AttnSpec.kind` takes


def step_kind(kind: str | None, scheme: str, r: int, causal: bool = True) -> str:
    """The `AttnSpec.kind` the kernels run at each step of a call of `kind` (None: dense, causal or
    full as `causal` says) under `scheme` across r ranks: per-row intervals for the all-gather's
    chunks and for any window or documents (ringflash/masks.py), else the dense kind."""
    if kind not in (None, *MASK_KINDS):
        raise ValueError(f"kind must be None (dense) or one of {MASK_KINDS}, got {kind!r}")
    dense = kind in (None, "causal", "full")
    if (scheme == "allgather" and r > 1) or not dense:
        return "intervals"
    return kind or ("causal" if causal else "full")


def predict(m: Model, seqlen: int, c: Cluster, u: int, r: int, transport: str = "nccl", layout: str = "zigzag",
            rates: KernelRates | None = None, scheme: str = "ring", heads_k_stride: int = 1, *,
            backend="triton", kind: str | None = None, softcap: float = 0.0) -> Prediction:  # fmt: skip
    """One layer's fwd + bwd time on a grid of u head ranks × r ranks running `scheme` (module
    docstring), at `rates`, or (None) at the shipped rates of the kernels that run a call of mask
    `kind` (an `AttnSpec.kind`; None: dense) and `softcap` on kernel `backend` (a name or a
    `kernels.Backend`; `kernel_rates.kernels_that_run`)."""
    if scheme not in ("ring", "allgather"):
        raise ValueError(f"scheme must be 'ring' or 'allgather', got {scheme!r}")
    kernels = ""
    if rates is None:
        kernels, _ = kernels_that_run(backend, step_kind(kind, scheme, r, m.causal), dtype_bytes=m.dtype_bytes,
                                      head_dim=m.head_dim, softcap=softcap)  # fmt: skip
        rates = KernelRates.default(kernels)
    h, hkv = m.heads // u, kv_heads_per_rank(m.heads, m.kv_heads, u)
    n = seqlen / r  # tokens of a ring shard (each head rank holds all of them after the all-to-all)
    one_node = u * r <= c.gpus_per_node
    lat = (c.nvlink_lat_us if one_node else c.ib_lat_us) * 1e-6
    slow = 1 + (c.nccl_sm_slowdown if transport == "nccl" and r > 1 else 0.0)
    if scheme == "allgather" and r > 1:
        bw = (c.nvlink_gbs if one_node else c.ib_gbs) * 1e9
        compute, across, serial = _allgather(m, rates, c, h, hkv, n, r, heads_k_stride, slow, bw, lat)
    else:
        hop = c.copy_engine_gbs if transport == "copy-engine" else c.nccl_pair_gbs if r == 2 else c.nccl_p2p_gbs
        bw = (hop if one_node else c.ib_gbs) * 1e9
        compute, across, serial = _ring(m, rates, c, h, hkv, n, r, layout, slow, bw, lat)
    a2a = _a2a(m, c, hkv, seqlen, u, r)
    time = across + a2a
    ideal_flops = (1 + BWD_FLOPS) * _flops(m, m.heads, seqlen, seqlen, m.causal)
    eff = ideal_flops / (u * r * time * rates.best(m.head_dim) * 1e12)
    mem = memory_bytes(m, seqlen, u, r, scheme, heads_k_stride)
    return Prediction(u, r, transport, layout, compute, across, a2a, time, eff, scheme, mem, serial + a2a, kernels)


def feasible(m: Model, c: Cluster) -> list[tuple[int, int, str, str]]:
    """Every (u, r, transport, scheme) that can run on all of the cluster's GPUs: u divides H, the
    K/V heads split or replicate (`kv_heads_per_rank`), copy engines only for a ring inside one
    node; pure head parallelism (r = 1) has no scheme and is listed once, as the ring."""
    out = []
    for u in range(1, c.gpus + 1):
        if c.gpus % u:
            continue
        try:
            kv_heads_per_rank(m.heads, m.kv_heads, u)
        except ValueError:
            continue
        r = c.gpus // u
        out.append((u, r, "nccl", "ring"))
        if r > 1 and u * r <= c.gpus_per_node:
            out.append((u, r, "copy-engine", "ring"))
        if r > 1:
            out.append((u, r, "nccl", "allgather"))
    return out


def plan(m: Model, seqlen: int, c: Cluster, layout: str = "zigzag", rates: KernelRates | None = None,
         heads_k_stride: int = 1, backend="triton", *, kind: str | None = None,
         softcap: float = 0.0) -> list[Prediction]:  # fmt: skip
    """Predictions of every feasible layout (`feasible`), fastest first, each at the shipped rates
    of the kernels that run its steps on kernel `backend` for a call of mask `kind` and `softcap`
    (`predict`: the all-gather's per-row intervals, windows and documents run on the Triton
    kernels wherever `backend` runs no such call); `rates`: one table for all."""
    preds = [predict(m, seqlen, c, u, r, t, layout, rates, scheme, heads_k_stride, backend=backend, kind=kind,
                     softcap=softcap) for u, r, t, scheme in feasible(m, c)]  # fmt: skip
    return sorted(preds, key=lambda p: p.time_s)


def recommend(preds: list[Prediction], c: Cluster) -> tuple[Prediction | None, str]:
    """The fastest of `preds` whose buffers fit `c.memory_gib`, and why, in one sentence (None: none fits)."""
    budget = c.memory_gib * 2**30
    fits = [p for p in preds if p.memory_bytes <= budget]
    if not fits:
        least = min(preds, key=lambda p: p.memory_bytes)
        return None, (f"no layout's buffers fit memory_gib = {c.memory_gib:g}: the least, {least.describe()}, needs "
                      f"{least.memory_bytes / 2**30:.1f} GiB")  # fmt: skip
    best = fits[0]
    why = [f"{best.describe()} is the fastest within {c.memory_gib:g} GiB of attention buffers "
           f"({best.time_s * 1e3:.2f} ms per layer, {best.memory_bytes / 2**30:.2f} GiB; communication exposed "
           f"{(best.time_s - best.compute_s) * 1e3:.2f} ms)"]  # fmt: skip
    # The runner-up of another kind (scheme, or head parallelism against the ring): rows of the same
    # kind that differ only in transport or grid say little about the choice. Its row in the table is named.
    kind = lambda p: (p.scheme, p.u == 1, p.r == 1)
    row, other = next(((i, p) for i, p in enumerate(preds, 1) if p in fits and kind(p) != kind(best)), (0, None))
    if other is not None:
        why.append(f"next-best of another kind (row {row} of {len(preds)}), {other.describe()}: "
                   f"{other.time_s * 1e3:.2f} ms (+{other.time_s / best.time_s - 1:.1%})")
    faster = [p for p in preds if p.time_s < best.time_s]
    if faster:
        why.append(f"{faster[0].describe()} would take {faster[0].time_s * 1e3:.2f} ms but needs "
                   f"{faster[0].memory_bytes / 2**30:.1f} GiB")  # fmt: skip
    return best, "; ".join(why)


def cluster_of(gpus: int, gpus_per_node: int, **links) -> Cluster:
    """The `Cluster` of a group of `gpus` consecutive ranks (a cp group: rank = dp_rank · cp + cp_rank)
    on nodes of `gpus_per_node`; `links`: the other `Cluster` fields.

    Node boundaries fall at multiples of `gpus_per_node` and the group starts at a multiple of
    `gpus`, so runs of gcd(gpus, gpus_per_node) aligned ranks never straddle a node: the group is
    modelled as such nodes (one node when it fits in one), never with more NVLink than it has."""
    per_node = math.gcd(gpus, max(gpus_per_node, 1))
    return Cluster(gpus_per_node=per_node, nodes=gpus // per_node, **links)


def choose_layout(m: Model, seqlen: int, c: Cluster, *, transport: str = "nccl", layout: str = "zigzag",
                  schemes: tuple[str, ...] = ("ring", "allgather"), u: int | None = None, heads_k_stride: int = 1,
                  rates: KernelRates | None = None, backend="triton", kind: str | None = None,
                  softcap: float = 0.0) -> tuple[Prediction, str]:  # fmt: skip
    """The layout to run one attention call on all of `c`'s GPUs, and why, in one sentence.

    Among the feasible grids (`feasible`: u divides H and splits or replicates the K/V heads)
    whose ranks across the heads run one of `schemes` over `transport`, the fastest whose buffers fit
    `c.memory_gib` (`recommend`), else the one needing least memory. Pure head parallelism (r = 1)
    has no scheme or transport and is always a candidate. Its `u` and `scheme` are what
    `hybrid_groups(u, group)` and `ring_flash_attn_func(scheme=)` (or the training config's
    `parallel.cp_heads` and `parallel.cp_scheme`) take.

    Arguments:
        m: the attention's shape (heads, K/V heads, head dim, batch, causal; dense: no window or documents).
        seqlen: tokens of one whole sequence, before it is sharded.
        c: the GPUs (`cluster_of(group size, GPUs per node)` for a process group).
        transport: the ring's, "nccl" or "copy-engine".
        layout: how the sequence is cut; "stripe" is balanced at every step and predicted as zigzag.
        schemes: the schemes to choose among, of "ring" and "allgather".
        u: only grids of this many head ranks (None: any).
        heads_k_stride, rates, backend: `plan`'s (backend: the kernel backend the layers run).
        kind, softcap: the call's mask (an `AttnSpec.kind`; None: dense) and softcap, which decide
            the kernels that run on `backend` (`kernel_rates.kernels_that_run`), not the work.
    Return:
        (the `Prediction` chosen, why; why also names the other transport's fastest layout when it
        is predicted 3% faster or more, and the kernels it is predicted at where `backend`'s
        own do not run the call). Raises ValueError if no grid is a candidate (the
        copy-engine across nodes, where u = all GPUs does not divide the heads).
    """
    predicted_as = "contiguous" if layout == "contiguous" else "zigzag"
    every = plan(m, seqlen, c, predicted_as, rates, heads_k_stride, backend, kind=kind, softcap=softcap)
    preds = [p for p in every
             if (p.r == 1 or (p.transport == transport and p.scheme in schemes)) and u in (None, p.u)]  # fmt: skip
    if not preds:
        grids = f"grid of {c.gpus} GPUs" + ("" if u is None else f" with u = {u} head ranks")
        raise ValueError(f"no {grids} runs {' or '.join(schemes)} over {transport} for {m.heads} heads and "
                         f"{m.kv_heads} K/V heads")  # fmt: skip
    best, why = recommend(preds, c)
    if best is None:
        best = min(preds, key=lambda p: p.memory_bytes)
        why += "; choosing it"
    # The transport is the caller's to choose (copy engines need one host and symmetric memory):
    # say when the other one is predicted clearly faster.
    other = [p for p in every if p.transport != transport and p.scheme in schemes and u in (None, p.u)
             and p.memory_bytes <= c.memory_gib * 2**30 and p.time_s < 0.97 * best.time_s]  # fmt: skip
    if other:
        alt = other[0]
        why += (f"; the {alt.transport} transport would be faster: {alt.describe()}, {alt.time_s * 1e3:.2f} ms "
                f"({alt.time_s / best.time_s - 1:+.1%})")  # fmt: skip
    if rates is None:
        own, fallback = kernels_that_run(backend, step_kind(kind, best.scheme, best.r, m.causal),
                                         dtype_bytes=m.dtype_bytes, head_dim=m.head_dim, softcap=softcap)  # fmt: skip
        if fallback:
            why += f"; at the {own} kernels' rates, which run it ({fallback})"
    return best, why


@functools.cache
def model_version() -> str:
    """The planner's model in 10 hex digits: a digest of what it predicts (time, compute, memory of
    every feasible layout) for a fixed set of shapes, sequences, clusters, masks and softcaps at every kernel
    backend's shipped rates. Any change to the code, the shipped rates, a default or the kernels'
    `supports` that moves a prediction moves it; the benchmarks store it beside their predictions."""
    return _digest(plan)


def _digest(plan_fn) -> str:
    """`model_version` of the model whose `plan` is `plan_fn`."""
    digest = hashlib.sha256()
    shapes = (Model(16, 16, 128), Model(32, 8, 128), Model(32, 8, 64), Model(8, 1, 128, causal=False))
    # (tokens per GPU, layout, mask kind, softcap)
    calls = ((8192, "zigzag", None, 0.0), (32768, "contiguous", None, 0.0), (8192, "zigzag", "intervals", 0.0),
             (8192, "zigzag", None, 30.0))  # fmt: skip
    for backend in BACKEND_IMPLS:
        for m in shapes:
            for gpus, per_node in ((2, 8), (4, 8), (16, 8)):
                for tokens, layout, kind, softcap in calls:
                    for p in plan_fn(m, tokens * gpus, cluster_of(gpus, per_node), layout, backend=backend,
                                     kind=kind, softcap=softcap):  # fmt: skip
                        line = f"{p.describe()} {p.time_s:.6g} {p.compute_s:.6g} {p.memory_bytes:.6g} {p.kernels}\n"
                        digest.update(line.encode())
    return digest.hexdigest()[:10]


if __name__ == "__main__":  # `python -m ringflash.plan`: the command line, which builds on this module
    import runpy

    runpy.run_module("ringflash.plan_cli", run_name="__main__")
