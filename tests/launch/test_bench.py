"""The ring benchmark's smoke run on CPU: the script keeps up with the ring's API.

Timings mean nothing here (gloo, tiny shapes, host wall clock); what is checked is that every
part of `launch/bench_ring.py --quick` runs and reports: the ring and compute-only rows, the
efficiency, and one K/V hop alone; and that a smoke run records nothing unless told where.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.dist_utils import REPO, torchrun

pytestmark = pytest.mark.slow  # torchrun launches of the benchmark script


def _recorded_state() -> dict:
    """BENCHMARKS.md and every file under benchmarks/, as bytes."""
    files = [REPO / "BENCHMARKS.md", *sorted((REPO / "benchmarks").glob("*"))]
    return {p: p.read_bytes() for p in files if p.is_file()}


def test_bench_ring_quick_runs_over_gloo(tmp_path):
    before = _recorded_state()
    out = torchrun(REPO / "launch" / "bench_ring.py", "--quick", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 256 | ringflash |")]
    assert len(rows) == 2, out.stdout  # zigzag and contiguous
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        # fwd, fwd+bwd, compute-only, single/W, efficiency, TFLOP/s, the planner's prediction
        assert len(cells) == 10 and all(float(c) > 0 for c in cells[3:]), row
    assert re.search(r"One K/V hop alone \(256 tokens/rank, nccl\): [0-9.e+-]+ ms for 0\.0625 MiB", out.stdout, re.I)
    assert "## Ring attention" in out.stdout  # printed,
    assert _recorded_state() == before  # not recorded
    assert not list(tmp_path.glob("**/*.jsonl"))


def test_bench_ring_rows_per_kernel_backend_recorded_where_asked(tmp_path):
    out = torchrun(REPO / "launch" / "bench_ring.py", "--quick", "--layouts", "zigzag", "--no-torch-cp",
                   "--kernel-backends", "auto,reference", "--record-to", tmp_path / "rec", cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    impls = [line.split("|")[2].strip() for line in out.stdout.splitlines() if line.startswith("| 256 | ringflash")]
    assert impls == ["ringflash", "ringflash [reference]"], out.stdout
    (line,) = (tmp_path / "rec" / "ring.jsonl").read_text().splitlines()  # rank 0 alone writes, once
    rec = json.loads(line)
    assert rec["benchmark"] == "ring" and rec["title"].startswith("Ring attention, 2 ranks (gloo)")
    assert [r["impl"] for r in rec["results"]] == impls and rec["peers"] == []
    # Predicted as on H100/H200s at the row's backend's rates (reference: the Triton kernels').
    from ringflash.plan import Cluster, KernelRates, Model, model_version, predict

    expected = predict(Model(2, 2, 32), 512, Cluster(gpus_per_node=2), 1, 2, rates=KernelRates.default())  # --quick
    assert [r["predicted ms"] for r in rec["results"]] == [round(expected.time_s * 1e3, 3)] * 2
    assert rec["args"]["plan_model"] == model_version()  # the model that made them (plan_validation)
    assert rec["args"]["kernel_backends"] == "auto,reference" and rec["args"]["transports"] == "nccl"
    assert rec["ceilings"]["kv_hop_alone"][0]["tokens_per_rank"] == 256
    bad = torchrun(REPO / "launch" / "bench_ring.py", "--quick", "--kernel-backends", "cudnn", cwd=tmp_path)
    assert bad.returncode != 0 and "--kernel-backends: each must be one of" in bad.stderr, bad.stderr[-3000:]
