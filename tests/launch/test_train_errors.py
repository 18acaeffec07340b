"""launch/train.py: an error that ends a run is one line per rank, before torchrun's own report;
an unexpected exception keeps its traceback."""

from __future__ import annotations

import importlib.util
import re

import pytest

from ringflash.hybrid import kv_heads_per_rank
from tests.dist_utils import REPO, torchrun


def _launch_script():
    spec = importlib.util.spec_from_file_location("launch_train", REPO / "launch" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_torchrun_error_is_one_line_per_rank_before_torchruns_report(tmp_path):
    out = torchrun(
        REPO / "launch" / "train.py",
        "--config",
        str(REPO / "configs" / "tiny_cpu.toml"),
        "--parallel.cp=3",
        "--parallel.layout=contiguous",
        "--data.seq_len=768",
        "--data.eval_buckets=6",
        f"--logging.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert out.returncode != 0
    lines = out.stderr.splitlines()
    message = "error: parallel.cp (3) must divide the world size (2); launch a multiple of cp processes"
    ours = [i for i, line in enumerate(lines) if "error: parallel.cp" in line]
    # torchrun stops the other rank once one has exited, so a slower rank may not get to print.
    assert ours, out.stderr
    for i in ours:
        assert re.fullmatch(rf"rank [01]: {re.escape(message)} \(torchrun --nproc_per_node\)", lines[i]), lines[i]
    # torchrun's report (its own traceback, ChildFailedError) follows; no rank printed a traceback.
    report = next(i for i, line in enumerate(lines) if "Traceback" in line or "ChildFailedError" in line)
    assert max(ours) < report, out.stderr
    assert "error_file" in out.stderr  # torchrun's report is there, after the lines


def test_library_input_error_is_one_line(monkeypatch, capsys):
    # A ValueError from ringflash's own checks (here the head-parallel rule) is bad input: one line, exit 2.
    launch = _launch_script()
    monkeypatch.setattr(launch, "train", lambda cfg: kv_heads_per_rank(32, 3, 2))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launch.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rank 1: error: ") and len(err.splitlines()) == 1, err


def test_unexpected_exception_keeps_its_traceback(monkeypatch):
    # Raised outside the library (a bug, or torch's): the traceback is what helps, so it propagates.
    def broken(cfg):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")

    launch = _launch_script()
    monkeypatch.setattr(launch, "train", broken)
    with pytest.raises(TypeError, match="unsupported operand"):
        launch.main([])
