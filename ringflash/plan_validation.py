"""The planner checked against the recorded multi-GPU runs: predicted vs measured fwd+bwd ms.

    python -m ringflash.plan_validation      # the table, from benchmarks/ring.jsonl and scaling.jsonl
    python launch/planner_plots.py           # the same table into docs/planner.md

A repository checkout only (benchmarks/ is not installed). Every scheme a record measured enters
the table by itself: `launch/bench_scaling.py`'s rows carry theirs.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from ringflash.kernel_rates import BACKEND_IMPLS, REPO, KernelRates, records
from ringflash.plan import Cluster, Model, predict

__all__ = ["validation_rows", "validation_table"]


def _waited_for_sums(rec: dict) -> bool:
    """Whether a record's ring made each fused backward wait for the arriving dK/dV sums: those
    measured before 59f5244 made them add the sums after their kernel (`KernelRates.late_add`), and
    that change's baseline (80216c8), measured beside it."""
    return rec.get("date", "") < "2026-11-27 17:04" or rec.get("commit") == "80216c8"


def validation_rows(path: Path = REPO / "benchmarks" / "ring.jsonl", c: Cluster | None = None,
                    rates: KernelRates | None = None,
                    scaling: Path | None = REPO / "benchmarks" / "scaling.jsonl") -> list[dict]:  # fmt: skip
    """Predicted vs measured fwd+bwd ms for every multi-GPU ringflash row of benchmarks/ring.jsonl
    (dense masks only, each at its kernel backend's rates and its transport; rows without a shape
    take the records' common one, B=1 H=16 Hkv=16 D=128),
    then for every dense row of `scaling` (launch/bench_scaling.py: ring, all-gather, head-parallel
    and the hybrids around either scheme; records before the all-gather measured the ring only)."""
    c, rates = c or Cluster(), rates or KernelRates.default()
    rows = []

    # A run on another backend's kernels is predicted from their own rates (`rates`: the Triton
    # kernels'), but for the all-gather: its per-row key intervals run on the Triton kernels there too.
    by_backend = {b: KernelRates.from_records(impl=impl) for b, impl in BACKEND_IMPLS.items() if b != "triton"}

    def row(source, i, rec, m, world, u, layout, tokens, measured, scheme="ring", stride=1, backend=None,
            transport="nccl"):  # fmt: skip
        r = rates if scheme == "allgather" else by_backend.get(backend, rates)
        if r.late_add and _waited_for_sums(rec):
            r = replace(r, late_add=False)
        ms = predict(m, tokens * world, c, u, world // u, transport, layout, r, scheme, stride).time_s * 1e3
        kernels = "triton" if scheme == "allgather" else backend or "triton"
        rows.append(dict(source=source, record=i, date=rec.get("date", "")[:10], W=world, grid=f"{u}×{world // u}",
                         scheme=scheme if transport == "nccl" else f"{scheme} ({transport})", kernels=kernels,
                         shape=f"{m.heads}/{m.kv_heads}/{m.head_dim}", layout=layout,
                         tokens=tokens, measured=measured, predicted=round(ms, 2),
                         error=round((ms - measured) / measured, 3)))  # fmt: skip

    for i, rec in enumerate(records(path)):
        a = rec.get("args", {})
        for x in rec.get("results", []):
            # "ringflash", "ringflash [hopper]", "ringflash [cudnn] (copy-engine)"; not the peers
            impl = re.fullmatch(r"ringflash(?: \[(\w+)\])?( \(copy-engine\))?", x.get("impl", "ringflash"))
            if "fwd+bwd ms" not in x or "tokens/rank" not in x or impl is None:
                continue
            if x.get("mask", "dense causal") != "dense causal":
                continue
            world = x.get("W") or a.get("world") or int(rec["title"].split(" ranks")[0].split()[-1])
            m = Model(a.get("heads", 16), a.get("kv_heads", 16), a.get("head_dim", 128), batch=a.get("batch", 1),
                      causal=a.get("causal", True))  # fmt: skip
            backend = impl[1] or a.get("backend")
            row("ring", i, rec, m, world, 1, x.get("layout", "zigzag"), x["tokens/rank"], x["fwd+bwd ms"],
                backend=backend, transport="copy-engine" if impl[2] else "nccl")  # fmt: skip
    for i, rec in enumerate(records(scaling) if scaling is not None and Path(scaling).exists() else []):
        a = rec["args"]
        if a.get("smoke"):
            continue
        for x in rec["results"]:
            if x["impl"].startswith("torch CP") or x.get("mask", "dense causal") != "dense causal":
                continue
            m = Model(*a["shapes"][x["shape"]], causal=a.get("causal", True))
            row("scaling", i, rec, m, x["W"], x["u"], a.get("layout", "zigzag"), x["tokens/GPU"], x["fwd+bwd ms"],
                x.get("scheme") or "ring", a.get("heads_k_stride", 1), a.get("backend"))  # fmt: skip
    return rows


def validation_table(rows: list[dict]) -> str:
    """The rows as markdown, then the error's median, 90th percentile and maximum, per scheme too
    when more than one was measured."""
    cols = ("source", "record", "date", "W", "grid", "scheme", "kernels", "shape", "layout", "tokens")
    lines = ["| source | record | date | W | grid u×r | scheme | kernels | H/Hkv/D | layout | tokens/GPU | measured ms "
             "| predicted ms | error |", "|" + "---|" * 13]  # fmt: skip
    lines += ["| " + " | ".join(str(r[k]) for k in cols)
              + f" | {r['measured']} | {r['predicted']} | {r['error']:+.1%} |" for r in rows]  # fmt: skip
    schemes = sorted({r["scheme"] for r in rows})
    groups = [("", rows)] + ([(f"{s}: ", [r for r in rows if r["scheme"] == s]) for s in schemes] if len(schemes) > 1
                             else [])  # fmt: skip
    lines.append("")
    for label, group in groups:
        errs = sorted(abs(r["error"]) for r in group)
        lines.append(f"{label}{len(group)} rows: median |error| {errs[len(errs) // 2]:.1%}, "
                     f"90th percentile {errs[int(0.9 * (len(errs) - 1))]:.1%}, max {errs[-1]:.1%}.")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    if not (REPO / "benchmarks" / "ring.jsonl").exists():
        raise SystemExit(f"error: the validation reads benchmarks/ring.jsonl of a repository checkout; {REPO} has none")
    print(validation_table(validation_rows()))


if __name__ == "__main__":
    main()
