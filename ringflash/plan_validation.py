"""The planner checked against the recorded multi-GPU runs: predicted vs measured fwd+bwd ms.

    python -m ringflash.plan_validation      # the table, from benchmarks/ring.jsonl and scaling.jsonl
    python launch/planner_plots.py           # the same table into docs/planner.md

A repository checkout only (benchmarks/ is not installed). Every scheme a record measured enters
the table by itself: `launch/bench_scaling.py`'s rows carry theirs.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from ringflash.kernel_rates import BACKEND_IMPLS, REPO, KernelRates, kernels_that_run, rates_backend, records
from ringflash.plan import Cluster, Model, predict, step_kind

__all__ = ["validation_rows", "validation_table"]


def kernel_spread(impl: str, head_dim: int, path: Path = REPO / "benchmarks" / "kernels.jsonl") -> float:
    """How far one run's kernel rates read from the pooled median: the largest |sample / median − 1|
    among the samples `KernelRates.from_records` pools for `impl` at `head_dim` (any length,
    causality, direction); 0 where no shape has two samples."""
    shapes = [by_n for (d, _, _), by_n in KernelRates.pooled(path, impl).items() if d == head_dim]
    return max((abs(v / statistics.median(vs) - 1) for by_n in shapes for vs in by_n.values() if len(vs) > 1
                for v in vs), default=0.0)  # fmt: skip


def validation_rows(path: Path = REPO / "benchmarks" / "ring.jsonl", c: Cluster | None = None,
                    rates: KernelRates | None = None,
                    scaling: Path | None = REPO / "benchmarks" / "scaling.jsonl") -> list[dict]:  # fmt: skip
    """Measured fwd+bwd ms against predictions for every multi-GPU ringflash row of
    benchmarks/ring.jsonl (dense masks only; rows without a shape take the records' common one,
    B=1 H=16 Hkv=16 D=128), then for every dense row of `scaling` (launch/bench_scaling.py: ring,
    all-gather, head-parallel and the hybrids around either scheme).

    Each row has two predictions: `predicted`, today's model (in-sample: it may have been tuned
    on the row), each at the shipped rates of the kernels that ran it (`rates`: one table for every
    row instead) and its transport, with its `compute` and `serial` (nothing overlapped) parts; and
    `floor`, the least time the model allows, its prediction less the kernel rates' spread over
    its compute (`kernel_spread`: the model leaves out time, never adds it); and `recorded`, the
    prediction the benchmark stored before it measured (held out: the model then
    had not seen the row; None where the record has none), with the model `version` that made
    it (`model_version()`, or "at <commit>" for records from before versions were stored)."""
    c = c or Cluster()
    rows = []
    spreads: dict = {}

    def row(source, i, rec, m, world, u, layout, tokens, x, scheme="ring", stride=1, backend=None,
            transport="nccl"):  # fmt: skip
        if (rec.get("args") or {}).get("plan_model"):  # the kernels its writer predicted at: those that ran
            step = step_kind(None, scheme, world // u, m.causal)
            kernels = kernels_that_run(backend or "triton", step, dtype_bytes=m.dtype_bytes, head_dim=m.head_dim)[0]
        else:  # before versions were stored, every all-gather ran its per-row intervals on Triton's kernels
            kernels = "triton" if scheme == "allgather" else rates_backend(backend or "triton")
        r = rates or KernelRates.default(kernels)
        p = predict(m, tokens * world, c, u, world // u, transport, layout, r, scheme, stride)
        measured, recorded = x["fwd+bwd ms"], x.get("predicted ms")
        key = (BACKEND_IMPLS[kernels], m.head_dim)
        spread = spreads[key] = spreads[key] if key in spreads else kernel_spread(*key)
        version = (rec.get("args") or {}).get("plan_model") or f"at {rec.get('commit', '?').split()[0]}"
        rows.append(dict(source=source, record=i, date=rec.get("date", "")[:10], W=world, grid=f"{u}×{world // u}",
                         scheme=scheme if transport == "nccl" else f"{scheme} ({transport})", kernels=kernels,
                         shape=f"{m.heads}/{m.kv_heads}/{m.head_dim}", layout=layout, tokens=tokens,
                         measured=measured, predicted=round(p.time_s * 1e3, 2),
                         error=round((p.time_s * 1e3 - measured) / measured, 3),
                         compute=round(p.compute_s * 1e3, 3), serial=round(p.serial_s * 1e3, 3),
                         floor=round((p.time_s - spread * p.compute_s) * 1e3, 3),
                         recorded=recorded, version=None if recorded is None else version,
                         held_out_error=None if recorded is None else round(recorded / measured - 1, 3)))  # fmt: skip

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
            row("ring", i, rec, m, world, 1, x.get("layout", "zigzag"), x["tokens/rank"], x,
                backend=backend, transport="copy-engine" if impl[2] else "nccl")  # fmt: skip
    for i, rec in enumerate(records(scaling) if scaling is not None and Path(scaling).exists() else []):
        a = rec["args"]
        if a.get("smoke"):
            continue
        for x in rec["results"]:
            if x["impl"].startswith("torch CP") or x.get("mask", "dense causal") != "dense causal":
                continue
            m = Model(*a["shapes"][x["shape"]], causal=a.get("causal", True))
            row("scaling", i, rec, m, x["W"], x["u"], a.get("layout", "zigzag"), x["tokens/GPU"], x,
                x.get("scheme") or "ring", a.get("heads_k_stride", 1), a.get("backend"))  # fmt: skip
    return rows


def _summary(label: str, errors: list[float]) -> str:
    errs = sorted(abs(e) for e in errors)
    return (f"{label}{len(errs)} rows: median |error| {errs[len(errs) // 2]:.1%}, 90th percentile "
            f"{errs[int(0.9 * (len(errs) - 1))]:.1%}, max {errs[-1]:.1%}.")  # fmt: skip


def validation_table(rows: list[dict]) -> str:
    """The rows as markdown, then the held-out and in-sample errors' median, 90th percentile and
    maximum (per scheme and at 8k tokens per GPU too), and the rows below their floor."""
    cols = ("source", "record", "date", "W", "grid", "scheme", "kernels", "shape", "layout", "tokens", "measured",
            "predicted")  # fmt: skip
    lines = ["| source | record | date | W | grid u×r | scheme | kernels | H/Hkv/D | layout | tokens/GPU "
             "| measured ms | predicted ms | error | floor ms | recorded ms | model | held-out error |",
             "|" + "---|" * 17]  # fmt: skip
    for r in rows:
        held = ("| | |" if r["recorded"] is None
                else f"| {r['recorded']} | {r['version']} | {r['held_out_error']:+.1%} |")  # fmt: skip
        lines.append("| " + " | ".join(str(r[k]) for k in cols) + f" | {r['error']:+.1%} | {r['floor']} " + held)
    held = [r for r in rows if r["recorded"] is not None]
    lines += ["", "Held out (the prediction each benchmark stored before it measured):"]
    if held:
        lines.append(_summary("", [r["held_out_error"] for r in held]))
        lines.append(_summary("at 8k tokens per GPU: ", [r["held_out_error"] for r in held if r["tokens"] == 8192]))
    lines += ["", "In sample (today's model, every row):", _summary("", [r["error"] for r in rows])]
    schemes = sorted({r["scheme"] for r in rows})
    if len(schemes) > 1:
        lines += [_summary(f"{s}: ", [r["error"] for r in rows if r["scheme"] == s]) for s in schemes]
    lines.append(_summary("at 8k tokens per GPU: ", [r["error"] for r in rows if r["tokens"] == 8192]))
    below = [r for r in rows if r["measured"] < r["floor"]]
    lines.append(f"Measured below the floor (faster than the model allows): {len(below)} of {len(rows)} rows.")
    return "\n".join(lines)


def main() -> None:
    if not (REPO / "benchmarks" / "ring.jsonl").exists():
        raise SystemExit(f"error: the validation reads benchmarks/ring.jsonl of a repository checkout; {REPO} has none")
    print(validation_table(validation_rows()))


if __name__ == "__main__":
    main()
