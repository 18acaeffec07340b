"""Kernel TFLOP/s by head dim, causality and direction, over block lengths: the planner's compute rates.

One table per kernel backend (`triton`, `hopper`, `cudnn`), shipped as ringflash/kernel_rates.json
(so an installed package needs no repository), made by `KernelRates.from_records()` from
benchmarks/kernels.jsonl of a repository checkout (`save_all` writes the shipped file).
"""

from __future__ import annotations

import importlib.resources
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BACKEND_IMPLS", "BWD_FLOPS", "REPO", "KernelRates", "kernels_that_run", "rates_backend", "records"]

REPO = Path(__file__).resolve().parent.parent  # benchmarks/ there: a repository checkout only
BWD_FLOPS = 2.5  # backward FLOPs / forward FLOPs (FlashAttention-2's accounting: 5 matmuls vs 2)
# Each kernel backend's kernels, as benchmarks/kernels.jsonl names them (`cudnn`: SDPA's cuDNN).
BACKEND_IMPLS = {"triton": "ringflash", "hopper": "ringflash-hopper", "cudnn": "sdpa-cudnn"}


def rates_backend(backend: str) -> str:
    """The backend of `BACKEND_IMPLS` whose rates stand for kernel backend `backend`: `hopper` and
    `cudnn` their own; `auto` the Hopper kernels' (what it runs on the H100/H200s these rates were
    measured on); `triton` and `reference` the Triton kernels'."""
    if backend == "auto":
        return "hopper"
    return backend if backend in BACKEND_IMPLS else "triton"


def kernels_that_run(backend, kind: str = "causal", *, dtype_bytes: int = 2, head_dim: int | None = None,
                     softcap: float = 0.0) -> tuple[str, str | None]:  # fmt: skip
    """(the backend of `BACKEND_IMPLS` whose kernels run attention of this `kind` (an
    `AttnSpec.kind`) on kernel backend `backend` (a name or a `kernels.Backend`), why it is not
    `backend`'s own or None): the backend's own where `Backend.supports(kind, dtype, head_dim)`
    says it runs the call, else Triton's, which the fused backends fall back to."""
    import torch

    from ringflash.kernels.backends import Backend, backend_named

    if backend == "auto":
        backend = rates_backend(backend)  # what auto runs on the H100/H200s of these rates
    b = backend if isinstance(backend, Backend) else backend_named(backend)
    own = rates_backend(b.name)
    if own == "triton":
        return own, None
    dtype = {2: torch.bfloat16, 4: torch.float32}.get(dtype_bytes)
    why = b.supports(kind, dtype, head_dim)
    # `supports` takes no softcap: the backend says whether its kernels cap scores.
    if why is None and softcap and not b.softcap:
        why = f"softcap={softcap:g}: the {own} kernels run no softcap"
    # A backend that runs every call but hands some to the Triton kernels (hopper) says which.
    if why is None and b.kernels_for(dtype, head_dim) != b.name:
        why = f"the {own} kernels run no {dtype} with head dim {head_dim}"
    return ("triton", why) if why else (own, None)


# The share of a backward's time before its dK/dV are complete, which a ring step can send on
# only then: the Triton backward runs its dK/dV kernel (4 of its 7 matmuls) before the dQ kernel;
# the Gluon and cuDNN backwards are one kernel, so their dK/dV leave after all of it.
DKDV_SHARE = {"ringflash": 4 / 7, "ringflash-hopper": 1.0, "sdpa-cudnn": 1.0}
# The backwards whose ring step adds the arriving dK/dV sums in a pass after its kernel (ring.py),
# so that they travel while the kernel runs; the Triton dK/dV kernel adds them in its epilogue.
LATE_ADD = {"ringflash-hopper", "sdpa-cudnn"}


def records(path: Path) -> list[dict]:
    """The JSON-lines records of a benchmarks/<name>.jsonl."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@dataclass
class KernelRates:
    """Kernel TFLOP/s by (head dim, causal, direction), tabulated over lengths N (log-interpolated).

    `from_records` takes ringflash's rows of the newest dense kernels.jsonl records (bf16, one H100 or
    H200: their kernels run within a few percent of each other),
    the median of the newest `POOLED` at each shape: one run's kernels read up to 5% off another's.
    """

    table: dict[tuple[int, bool, str], list[tuple[int, float]]] = field(default_factory=dict)
    dkdv_share: float = DKDV_SHARE["ringflash"]  # of the backward's time, before dK/dV are complete
    late_add: bool = False  # the arriving dK/dV sums added after the kernel (`LATE_ADD`)
    POOLED = 5

    @classmethod
    def from_records(cls, path: Path = REPO / "benchmarks" / "kernels.jsonl", impl: str = "ringflash") -> KernelRates:
        """`impl`: whose kernels, as kernels.jsonl names them (`ringflash`: the Triton kernels;
        `ringflash-hopper`: the Gluon ones; `BACKEND_IMPLS` maps the kernel backends)."""
        samples = cls.pooled(path, impl)
        table = {k: sorted((n, statistics.median(v)) for n, v in by_n.items()) for k, by_n in samples.items()}
        return cls._of(impl, table)

    @classmethod
    def pooled(cls, path: Path, impl: str) -> dict[tuple[int, bool, str], dict[int, list[float]]]:
        """The TFLOP/s samples `from_records` takes the median of: {(head dim, causal, direction):
        {N: one sample per pooled record}}."""
        # Dense MHA tables only: a GQA run (args.group) covers one head dim and its own tiles.
        recs = [r for r in records(path) if (r.get("args") or {}).get("group", 1) == 1
                and any(x.get("impl") == impl and "N" in x for x in r.get("results", []))]  # fmt: skip
        samples: dict = {}
        for record in sorted(recs, key=lambda r: r["date"])[-cls.POOLED :]:
            for x in record["results"]:
                if x.get("impl") != impl:
                    continue
                for direction in ("fwd", "bwd"):
                    by_n = samples.setdefault((x["D"], x["causal"] == "yes", direction), {})
                    by_n.setdefault(x["N"], []).append(float(x[f"{direction} TFLOP/s"]))
        return samples

    @classmethod
    def _of(cls, impl: str, table: dict) -> KernelRates:
        """`impl`'s rates `table`, with what its backward's structure implies for a ring step."""
        return cls(table, DKDV_SHARE.get(impl, 1.0), impl in LATE_ADD)

    @classmethod
    def default(cls, backend: str = "triton") -> KernelRates:
        """The rates shipped with the package for a kernel backend (`triton`, `hopper`, `cudnn`; the
        others run Triton's kernels on GPUs): ringflash/kernel_rates.json, `from_records` of the
        repository's benchmarks/kernels.jsonl when it was last regenerated."""
        return cls.load(importlib.resources.files("ringflash") / "kernel_rates.json", backend)

    @classmethod
    def load(cls, path, backend: str = "triton") -> KernelRates:
        """One backend's rates from a file `save_all` wrote, or (a `.jsonl` path) `from_records` of
        a kernels.jsonl."""
        impl = BACKEND_IMPLS[rates_backend(backend)]
        if str(path).endswith(".jsonl"):
            return cls.from_records(Path(path), impl)
        text = path.read_text() if hasattr(path, "read_text") else Path(path).read_text()
        saved = json.loads(text)["backends"][impl]
        table = {(r["head_dim"], r["causal"], r["direction"]): [tuple(pt) for pt in r["points"]]
                 for r in saved["rates"]}  # fmt: skip
        return cls._of(impl, table)

    @classmethod
    def save_all(cls, path: Path, records_path: Path = REPO / "benchmarks" / "kernels.jsonl") -> None:
        """Write every backend's `from_records` as JSON (the shipped file: docs/planner.md says when)."""
        backends = {}
        for impl in BACKEND_IMPLS.values():
            rates = cls.from_records(records_path, impl)
            rows = [{"head_dim": d, "causal": c, "direction": k, "points": [list(pt) for pt in pts]}
                    for (d, c, k), pts in sorted(rates.table.items())]  # fmt: skip
            backends[impl] = {"rates": rows}
        source = f"KernelRates.from_records: the median of the newest {cls.POOLED} dense records per shape"
        Path(path).write_text(json.dumps({"source": source, "backends": backends}, indent=1) + "\n")

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
