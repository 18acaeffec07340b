"""Smoke tests of issue 29's multi-GPU scripts on CPU gloo: the hybrid exactness check of
launch/check_ring_nccl.py (4 ranks, U = 2; the all-gather scheme and the attention features) and
launch/bench_scaling.py --smoke with its record.

Both launch torchrun, so both are in the slow set (pytest -m slow)."""

from __future__ import annotations

import json

import pytest

from tests.dist_utils import REPO, torchrun

pytestmark = pytest.mark.slow  # torchrun launches


def test_check_ring_nccl_hybrid_passes_on_gloo(tmp_path):
    out = torchrun(REPO / "launch" / "check_ring_nccl.py", "--head-parallel", "2", "--tokens-per-rank", "64",
                   "--head-dim", "32", nproc=4, cwd=tmp_path, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "hybrid u=2 head x r=2 ring over 4 gloo ranks" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "PASS", out.stdout
    assert "FAIL" not in out.stdout


@pytest.mark.parametrize(
    "args, header",
    [(("--scheme", "allgather", "--head-parallel", "2", "--window-size", "40,0"), "hybrid u=2 head x r=2 allgather"),
     (("--softcap", "5", "--sink", "--window-size", "30,9"), "ring over 4 gloo ranks")],
)  # fmt: skip
def test_check_ring_nccl_features_pass_on_gloo(tmp_path, args, header):
    # The features' naive references: a window, softcapping and a sink's gradient summed over ranks.
    out = torchrun(REPO / "launch" / "check_ring_nccl.py", *args, "--tokens-per-rank", "32", "--head-dim", "16",
                   nproc=4, cwd=tmp_path, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert header in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "PASS", out.stdout
    assert "FAIL" not in out.stdout and ("dsink" in out.stdout) == ("--sink" in args)


def test_bench_scaling_smoke_records_with_prediction(tmp_path):
    out = torchrun(REPO / "launch" / "bench_scaling.py", "--smoke", "--shapes", "gqa", "--record-to", str(tmp_path),
                   nproc=2, cwd=tmp_path, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = (tmp_path / "scaling.jsonl").read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["benchmark"] == "scaling" and rec["args"]["world"] == 2 and rec["args"]["smoke"]
    impls = {(row["scaling"], row["impl"]) for row in rec["results"]}
    # W = 2: u = 1 (ring) and u = 2 (head-parallel, r = 1); weak and strong.
    assert impls == {(m, i) for m in ("weak", "strong") for i in ("ring", "head-parallel")}
    for row in rec["results"]:
        assert row["u"] * row["r"] == 2
        assert row["fwd+bwd ms"] > 0 and row["efficiency"] > 0
        assert row["predicted ms"] > 0 and 0 < row["predicted efficiency"] <= 1.5
