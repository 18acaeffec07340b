"""Which context-parallel layout to run: an analytic cost model of one attention layer.

    python -m ringflash.plan --heads 32 --kv-heads 8 --head-dim 128 --layers 32 \\
        --seqlen 1M --gpus 128                       # or --gpus-per-node 8 --nodes 16
    python -m ringflash.plan --validate            # predicted vs measured, benchmarks/ring.jsonl, scaling.jsonl

For a grid of `u` head-parallel × `r` ring ranks (ringflash/hybrid.py; u = 1 the ring, r = 1
pure head parallelism) and a transport for the ring's blocks, the forward + backward time of one
layer is the sum of:
- **ring steps**: step s computes its block pair (the layout's schedule: zigzag's half blocks,
  contiguous's full block on the critical rank, the causal diagonal at step 0) while the next
  K/V block travels, so a step costs max(compute, transfer) + a fixed per-step overhead; in the
  backward the float32 dK/dV travel beside the K/V. Compute = FLOPs / the kernel rate recorded
  in benchmarks/kernels.jsonl at that block's length and head dim (interpolated in log length;
  shipped as ringflash/kernel_rates.json, so an installed package needs no repository);
  NCCL's transfer kernels take SMs from attention (`nccl_sm_slowdown`), copy engines do not.
- **all-to-alls** (u > 1): q, k, v to heads and o back (forward), dO to heads and dq, dk, dv
  back (backward), exposed (nothing overlaps them); over NVLink when the head group fits in a
  node (heads are the inner grid dimension), else partly over InfiniBand.
The ring's links are NVLink when the whole grid is one node, else InfiniBand (its slowest hop).
Efficiency = the unsharded attention's FLOPs / (GPUs · time · the kernel's best recorded rate).
Not modelled: memory limits, the host's launch lead, congestion between concurrent rings.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import math
import statistics
from dataclasses import dataclass, field, fields
from pathlib import Path

from ringflash.hybrid import kv_heads_per_rank

__all__ = ["Cluster", "KernelRates", "Model", "Prediction", "feasible", "main", "predict", "validation_rows"]

REPO = Path(__file__).resolve().parent.parent  # benchmarks/ there: a repository checkout only
BWD_FLOPS = 2.5  # backward FLOPs / forward FLOPs (FlashAttention-2's accounting: 5 matmuls vs 2)


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


@dataclass(frozen=True)
class Cluster:
    """GPUs and links. Bandwidths in GB/s per GPU, one direction; latencies in µs.

    Defaults: H100/H200 SXM nodes: NVLink 4 at 900 GB/s both ways (450 one way) of which NCCL p2p
    reaches ~80%; one 400 Gb/s InfiniBand NIC per GPU (50 GB/s, ~85% reached); latencies of a
    small NCCL message; `step_overhead_us`: per ring step and direction (launches, waits);
    `nccl_sm_slowdown`: attention's slowdown while an NCCL transfer kernel holds SMs.
    """

    gpus_per_node: int = field(default=8, metadata={"help": "GPUs of one node (NVLink between them)"})
    nodes: int = field(default=1, metadata={"help": "nodes (InfiniBand between them)"})
    nvlink_gbs: float = field(default=360.0, metadata={"help": "NVLink GB/s per GPU, one direction, as NCCL reaches"})
    ib_gbs: float = field(default=42.0, metadata={"help": "InfiniBand GB/s per GPU, one direction, as NCCL reaches"})
    nvlink_lat_us: float = field(default=10.0, metadata={"help": "latency of a small NCCL message over NVLink, µs"})
    ib_lat_us: float = field(default=20.0, metadata={"help": "latency of a small NCCL message over InfiniBand, µs"})
    a2a_efficiency: float = field(
        default=0.8, metadata={"help": "all-to-all bandwidth / point-to-point bandwidth (NCCL's, on NVLink)"}
    )
    step_overhead_us: float = field(
        default=60.0, metadata={"help": "fixed cost of a ring step per direction (launches, waits), µs"}
    )
    nccl_sm_slowdown: float = field(
        default=0.05, metadata={"help": "attention's slowdown while an NCCL transfer kernel holds SMs"}
    )

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class KernelRates:
    """Kernel TFLOP/s by (head dim, causal, direction), tabulated over lengths N (log-interpolated).

    `from_records` takes ringflash's rows of the newest dense kernels.jsonl records (bf16, one H100 or
    H200: their kernels run within a few percent of each other),
    the median of the newest `POOLED` at each shape: one run's kernels read up to 5% off another's.
    """

    table: dict[tuple[int, bool, str], list[tuple[int, float]]] = field(default_factory=dict)
    POOLED = 5

    @classmethod
    def from_records(cls, path: Path = REPO / "benchmarks" / "kernels.jsonl") -> KernelRates:
        records = _records(path)
        # Dense MHA tables only: a GQA run (args.group) covers one head dim and its own tiles.
        records = [r for r in records if (r.get("args") or {}).get("group", 1) == 1
                   and any(x.get("impl") == "ringflash" and "N" in x for x in r.get("results", []))]
        samples: dict = {}
        for record in sorted(records, key=lambda r: r["date"])[-cls.POOLED:]:
            for x in record["results"]:
                if x.get("impl") != "ringflash":
                    continue
                for direction in ("fwd", "bwd"):
                    by_n = samples.setdefault((x["D"], x["causal"] == "yes", direction), {})
                    by_n.setdefault(x["N"], []).append(float(x[f"{direction} TFLOP/s"]))
        return cls({k: sorted((n, statistics.median(v)) for n, v in by_n.items()) for k, by_n in samples.items()})

    @classmethod
    def default(cls) -> KernelRates:
        """The rates shipped with the package (ringflash/kernel_rates.json, `from_records` of the
        repository's benchmarks/kernels.jsonl when it was last regenerated)."""
        return cls.load(importlib.resources.files("ringflash") / "kernel_rates.json")

    @classmethod
    def load(cls, path) -> KernelRates:
        """Rates saved by `save`, or (a `.jsonl` path) `from_records` of a kernels.jsonl."""
        if str(path).endswith(".jsonl"):
            return cls.from_records(Path(path))
        text = path.read_text() if hasattr(path, "read_text") else Path(path).read_text()
        rows = json.loads(text)["rates"]
        return cls({(r["head_dim"], r["causal"], r["direction"]): [tuple(pt) for pt in r["points"]] for r in rows})

    def save(self, path: Path) -> None:
        """Write the table as JSON (regenerate the shipped one: docs/planner.md)."""
        rows = [{"head_dim": d, "causal": c, "direction": k, "points": [list(pt) for pt in pts]}
                for (d, c, k), pts in sorted(self.table.items())]  # fmt: skip
        source = f"KernelRates.from_records: the median of the newest {self.POOLED} dense records per shape"
        Path(path).write_text(json.dumps({"source": source, "rates": rows}, indent=1) + "\n")

    @classmethod
    def constant(cls, fwd: float, bwd: float) -> KernelRates:
        """The same rate at every shape (tests, what-ifs)."""
        return cls({(0, c, d): [(1, r)] for c in (False, True) for d, r in (("fwd", fwd), ("bwd", bwd))})

    def rate(self, head_dim: int, n: float, causal: bool, direction: str) -> float:
        """TFLOP/s at block length n: nearest recorded head dim; log-linear between recorded lengths,
        below the shortest extrapolated along the first segment's slope (small blocks run slower),
        above the longest held flat."""
        dims = sorted({d for d, _, _ in self.table})
        d = min(dims, key=lambda x: abs(math.log2(max(x, 1)) - math.log2(head_dim)))
        pts = self.table[(d, causal, direction)]
        if len(pts) == 1 or n >= pts[-1][0]:
            return pts[-1][1] if n >= pts[-1][0] else pts[0][1]
        i = max(0, next((j for j, (m, _) in enumerate(pts) if m > n), len(pts) - 1) - 1)
        (n0, r0), (n1, r1) = pts[i], pts[i + 1]
        t = (math.log(max(n, 1)) - math.log(n0)) / (math.log(n1) - math.log(n0))
        return max(r0 + t * (r1 - r0), 0.05 * r0)

    def best(self, head_dim: int) -> float:
        """The best recorded fwd+bwd rate at this head dim, causal or not: the single-GPU ideal."""
        f, b = (max(self.rate(head_dim, 1e9, c, d) for c in (False, True)) for d in ("fwd", "bwd"))
        return (1 + BWD_FLOPS) / (1 / f + BWD_FLOPS / b)


@dataclass(frozen=True)
class Prediction:
    u: int
    r: int
    transport: str
    layout: str
    compute_s: float  # kernel time on the critical rank (fwd + bwd), no communication
    ring_s: float  # the ring's steps, transfers overlapped (fwd + bwd), compute included
    a2a_s: float  # the head all-to-alls, exposed
    time_s: float  # one layer, fwd + bwd
    efficiency: float


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


def predict(m: Model, seqlen: int, c: Cluster, u: int, r: int, transport: str = "nccl", layout: str = "zigzag",
            rates: KernelRates | None = None) -> Prediction:  # fmt: skip
    """One layer's fwd + bwd time on a grid of u head ranks × r ring ranks (module docstring)."""
    rates = rates or KernelRates.default()
    h, hkv = m.heads // u, kv_heads_per_rank(m.heads, m.kv_heads, u)
    n = seqlen / r  # tokens of a ring shard (each head rank holds all of them after the all-to-all)
    one_node = u * r <= c.gpus_per_node
    bw = (c.nvlink_gbs if one_node else c.ib_gbs) * 1e9
    lat = (c.nvlink_lat_us if one_node else c.ib_lat_us) * 1e-6
    kv_bytes = 2 * m.batch * n * hkv * m.head_dim * m.dtype_bytes
    dkv_bytes = 2 * m.batch * n * hkv * m.head_dim * 4  # float32 sums travel behind their block
    slow = 1 + (c.nccl_sm_slowdown if transport == "nccl" and r > 1 else 0.0)
    overhead = c.step_overhead_us * 1e-6 if r > 1 else 0.0
    compute = ring = 0.0
    for direction, flops_x, comm_bytes in (("fwd", 1.0, kv_bytes), ("bwd", BWD_FLOPS, kv_bytes + dkv_bytes)):
        for s, (nq, nk, causal) in enumerate(_steps(m, r, n, layout)):
            rate = rates.rate(m.head_dim, math.sqrt(nq * nk), causal, direction) * 1e12
            t = flops_x * _flops(m, h, nq, nk, causal) / rate
            compute += t
            in_flight = s < r - 1 or (direction == "bwd" and r > 1)  # the backward's last dK/dV hop too
            hop = lat + (comm_bytes if s < r - 1 else kv_bytes) / bw
            ring += (max(t * slow, hop) if in_flight else t) + overhead
    a2a = 0.0
    if u > 1:
        n_loc = seqlen / (u * r)
        elems = m.batch * n_loc * m.head_dim * m.dtype_bytes * (u - 1) / u  # bytes per head sent away
        calls = [m.heads + 2 * hkv * u, m.heads, m.heads, m.heads + 2 * hkv * u]  # qkv, o; do, dqkv
        intra = min(u, c.gpus_per_node) / u  # share of peers inside the node (heads are the inner dim)
        for heads in calls:
            b = elems * heads
            t_nvl = b * intra / (c.nvlink_gbs * c.a2a_efficiency * 1e9)
            t_ib = b * (1 - intra) / (c.ib_gbs * c.a2a_efficiency * 1e9) if intra < 1 else 0.0
            a2a += max(t_nvl, t_ib) + (c.nvlink_lat_us if intra == 1 else c.ib_lat_us) * 1e-6
    time = ring + a2a
    ideal_flops = (1 + BWD_FLOPS) * _flops(m, m.heads, seqlen, seqlen, m.causal)
    eff = ideal_flops / (u * r * time * rates.best(m.head_dim) * 1e12)
    return Prediction(u, r, transport, layout, compute, ring, a2a, time, eff)


def feasible(m: Model, c: Cluster) -> list[tuple[int, int, str]]:
    """Every (u, r, transport) the grid can run on all of the cluster's GPUs: u divides H, the K/V
    heads split or replicate (`kv_heads_per_rank`), copy engines only for a ring inside one node."""
    out = []
    for u in range(1, c.gpus + 1):
        if c.gpus % u:
            continue
        try:
            kv_heads_per_rank(m.heads, m.kv_heads, u)
        except ValueError:
            continue
        r = c.gpus // u
        out.append((u, r, "nccl"))
        if r > 1 and u * r <= c.gpus_per_node:
            out.append((u, r, "copy-engine"))
    return out


def plan(
    m: Model, seqlen: int, c: Cluster, layout: str = "zigzag", rates: KernelRates | None = None
) -> list[Prediction]:
    """Predictions of every feasible grid, fastest first."""
    rates = rates or KernelRates.default()
    preds = [predict(m, seqlen, c, u, r, t, layout, rates) for u, r, t in feasible(m, c)]
    return sorted(preds, key=lambda p: p.time_s)


# ---- validation against the recorded ring runs -------------------------------------------------


def validation_rows(path: Path = REPO / "benchmarks" / "ring.jsonl", c: Cluster | None = None,
                    rates: KernelRates | None = None,
                    scaling: Path | None = REPO / "benchmarks" / "scaling.jsonl") -> list[dict]:  # fmt: skip
    """Predicted vs measured fwd+bwd ms for every multi-GPU ringflash row of benchmarks/ring.jsonl
    (dense masks only; rows without a shape take the records' common one, B=1 H=16 Hkv=16 D=128),
    then for every ring, head-parallel and hybrid row of `scaling` (launch/bench_scaling.py)."""
    c, rates = c or Cluster(), rates or KernelRates.default()
    rows = []

    def row(source, i, rec, m, world, u, layout, tokens, measured):
        ms = predict(m, tokens * world, c, u, world // u, "nccl", layout, rates).time_s * 1e3
        rows.append(dict(source=source, record=i, date=rec.get("date", "")[:10], W=world, grid=f"{u}×{world // u}",
                         shape=f"{m.heads}/{m.kv_heads}/{m.head_dim}", layout=layout, tokens=tokens,
                         measured=measured, predicted=round(ms, 2), error=round((ms - measured) / measured, 3)))

    for i, rec in enumerate(_records(path)):
        a = rec.get("args", {})
        for x in rec.get("results", []):
            if "fwd+bwd ms" not in x or "tokens/rank" not in x or x.get("impl", "ringflash") != "ringflash":
                continue
            if x.get("mask", "dense causal") != "dense causal":
                continue
            world = x.get("W") or a.get("world") or int(rec["title"].split(" ranks")[0].split()[-1])
            m = Model(a.get("heads", 16), a.get("kv_heads", 16), a.get("head_dim", 128), batch=a.get("batch", 1),
                      causal=a.get("causal", True))  # fmt: skip
            row("ring", i, rec, m, world, 1, x.get("layout", "zigzag"), x["tokens/rank"], x["fwd+bwd ms"])
    for i, rec in enumerate(_records(scaling) if scaling is not None and Path(scaling).exists() else []):
        a = rec["args"]
        if a.get("smoke"):
            continue
        for x in rec["results"]:
            if x["impl"] not in ("ring", "head-parallel", "hybrid"):
                continue
            m = Model(*a["shapes"][x["shape"]], causal=a.get("causal", True))
            row("scaling", i, rec, m, x["W"], x["u"], a.get("layout", "zigzag"), x["tokens/GPU"], x["fwd+bwd ms"])
    return rows


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def validation_table(rows: list[dict]) -> str:
    errs = sorted(abs(r["error"]) for r in rows)
    cols = ("source", "record", "date", "W", "grid", "shape", "layout", "tokens")
    lines = ["| source | record | date | W | grid u×r | H/Hkv/D | layout | tokens/GPU | measured ms | predicted ms "
             "| error |", "|" + "---|" * 11]  # fmt: skip
    lines += ["| " + " | ".join(str(r[k]) for k in cols)
              + f" | {r['measured']} | {r['predicted']} | {r['error']:+.1%} |" for r in rows]  # fmt: skip
    lines.append(f"\n{len(rows)} rows: median |error| {errs[len(errs) // 2]:.1%}, "
                 f"90th percentile {errs[int(0.9 * (len(errs) - 1))]:.1%}, max {errs[-1]:.1%}.")  # fmt: skip
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------------


def _tokens(s: str) -> int:
    mult = {"k": 1024, "m": 1024**2}.get(s[-1].lower(), 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        # Flags and options without a value say what happens when absent in their help instead.
        return action.help if action.default in (None, False) else super()._get_help_string(action)


_COLUMNS = """columns: u head-parallel ranks x r ring ranks and the ring's transport; layer ms: one attention
layer's forward + backward; a2a ms: its all-to-alls (exposed); model s: layer ms x --layers, the
attention of one training step (no MLPs, no optimizer); efficiency: the unsharded attention's FLOPs
/ (GPUs x time x the kernel's best rate)."""


def _positive(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ringflash.plan",
        description=__doc__.split("\n")[0] + "\nThe defaults are Llama-3-8B's attention (32 heads, 8 K/V heads, "
        "head dim 128, 32 layers) at 1M tokens on one node of 8 H100/H200 GPUs.",
        epilog=_COLUMNS,
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--heads", type=_positive, default=32, help="query heads")
    p.add_argument("--kv-heads", type=_positive, default=8, help="K/V heads (GQA; = --heads for MHA)")
    p.add_argument("--head-dim", type=_positive, default=128, help="head dimension")
    p.add_argument("--layers", type=_positive, default=32, help="attention layers (the 'model s' column)")
    p.add_argument("--batch", type=_positive, default=1, help="sequences per step")
    p.add_argument("--seqlen", type=_tokens, default="1M", help="global tokens per sequence, e.g. 131072, 128k, 1M")
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"), help="how the ring cuts a sequence")
    p.add_argument("--non-causal", action="store_true", help="full attention instead of causal")
    p.add_argument("--kernels", metavar="PATH", help="a kernels.jsonl to take the kernel rates from "
                   "(without: those shipped in ringflash/kernel_rates.json)")  # fmt: skip
    p.add_argument("--validate", action="store_true", help="print predicted vs measured for benchmarks/ring.jsonl "
                   "and scaling.jsonl (a repository checkout)")  # fmt: skip
    gpus = p.add_mutually_exclusive_group()
    gpus.add_argument("--gpus", type=_positive, help="all GPUs: --gpus-per-node of them per node "
                      "(fewer: one node of that many); instead of --nodes")  # fmt: skip
    for f in fields(Cluster):
        kind = _positive if f.name in ("gpus_per_node", "nodes") else type(f.default)
        (gpus if f.name == "nodes" else p).add_argument(
            "--" + f.name.replace("_", "-"), type=kind, default=f.default, help=f.metadata["help"]
        )
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    a = p.parse_args(argv)
    if a.gpus is not None:
        if a.gpus <= a.gpus_per_node:
            a.gpus_per_node, a.nodes = a.gpus, 1
        elif a.gpus % a.gpus_per_node:
            p.error(f"argument --gpus: {a.gpus} GPUs do not fill nodes of --gpus-per-node {a.gpus_per_node}")
        else:
            a.nodes = a.gpus // a.gpus_per_node
    c = Cluster(**{f.name: getattr(a, f.name) for f in fields(Cluster)})
    rates = KernelRates.load(a.kernels) if a.kernels else KernelRates.default()
    if a.validate:
        if not (REPO / "benchmarks" / "ring.jsonl").exists():
            p.error(f"--validate reads benchmarks/ring.jsonl of a repository checkout; {REPO} has none")
        print(validation_table(validation_rows(c=c, rates=rates)))
        return
    m = Model(a.heads, a.kv_heads, a.head_dim, a.layers, a.batch, not a.non_causal)
    preds = plan(m, a.seqlen, c, a.layout, rates)
    print(f"H={m.heads} Hkv={m.kv_heads} D={m.head_dim} layers={m.layers} B={m.batch} N={a.seqlen} on "
          f"{c.nodes}x{c.gpus_per_node} GPUs ({a.layout}, {'causal' if m.causal else 'non-causal'})")  # fmt: skip
    print(f"{'u':>5} {'r':>5} {'transport':>12} {'layer ms':>10} {'a2a ms':>8} {'model s':>9} {'efficiency':>10}")
    for q in preds:
        print(f"{q.u:>5} {q.r:>5} {q.transport:>12} {q.time_s * 1e3:>10.2f} {q.a2a_s * 1e3:>8.2f} "
              f"{q.time_s * m.layers:>9.3f} {q.efficiency:>10.1%}")  # fmt: skip
    if not preds:
        print("no feasible grid (u must divide H and split or replicate the K/V heads)")
        return
    best = preds[0]
    print(
        f"recommended: u={best.u} head-parallel x r={best.r} ring, transport {best.transport} "
        f"(parallel.cp_heads={best.u}, cp={best.u * best.r})"
    )
    print("model s = layer ms x layers: attention only, forward + backward of one step (--help explains each column)")


if __name__ == "__main__":
    main()
