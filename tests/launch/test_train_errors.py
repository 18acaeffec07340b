"""launch/train.py: an error that ends a run is one line per rank, before torchrun's own report;
an unexpected exception keeps its traceback."""

from __future__ import annotations

import importlib.util
import json

import pytest

from ringflash.hybrid import kv_heads_per_rank
from tests.dist_utils import REPO, torchrun


def _launch_script():
    spec = importlib.util.spec_from_file_location("launch_train", REPO / "launch" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CP_ERROR = (
    "error: parallel.cp (3) must divide the world size (2); launch a multiple of cp processes "
    "(torchrun --nproc_per_node)"
)


@pytest.mark.slow
def test_torchrun_configuration_error_is_one_line_from_rank_0_before_torchruns_report(tmp_path):
    # The world size is the cause of the lengths' errors (seq_len and eval_buckets do not split over
    # 2·cp = 6 chunks): it is the one reported.
    out = torchrun(
        REPO / "launch" / "train.py",
        "--config",
        str(REPO / "configs" / "tiny_cpu.toml"),
        "--parallel.cp=3",
        f"--logging.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert out.returncode != 0
    lines = out.stderr.splitlines()
    ours = [i for i, line in enumerate(lines) if "error:" in line and "parallel.cp" in line]
    assert [lines[i] for i in ours[:1]] == [CP_ERROR], out.stderr
    assert "rank 1" not in out.stderr.replace("rank      : 1", ""), out.stderr  # the other rank is quiet
    # torchrun's report (its own traceback, ChildFailedError) follows, its root cause our line.
    report = next(i for i, line in enumerate(lines) if "Traceback" in line or "ChildFailedError" in line)
    assert ours[0] < report, out.stderr
    assert f"traceback : {CP_ERROR}" in out.stderr  # from the error file rank 0 wrote
    assert len(ours) == 2, out.stderr  # the line, and the report quoting it


def _cp3(tmp_path) -> list[str]:
    return ["--config", str(REPO / "configs" / "tiny_cpu.toml"), "--parallel.cp=3", f"--logging.dir={tmp_path}"]


@pytest.mark.parametrize(
    "rank, local_rank, said",
    [(0, 0, CP_ERROR), (1, 1, ""), (2, 0, f"rank 2: {CP_ERROR}")],  # rank 2: the first of another node
)
def test_configuration_error_is_said_once_per_node(tmp_path, monkeypatch, capsys, rank, local_rank, said):
    launch = _launch_script()
    for key, value in (("RANK", rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", 2)):
        monkeypatch.setenv(key, str(value))
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert launch.main(_cp3(tmp_path), quiet_wait_s=0) == 2
    assert capsys.readouterr().err == (f"{said}\n" if said else "")
    if said:  # torchrun's report quotes it
        assert json.loads(error_file.read_text())["message"]["message"] == said
    else:
        assert not error_file.exists()


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


@pytest.mark.parametrize("rank, said", [(0, "error: checkpoint x has no manifest.json\n"), (1, "")])
def test_an_error_the_ranks_agreed_on_is_said_by_rank_0_alone(monkeypatch, capsys, rank, said):
    # Raised alike by every rank after comparing notes (a checkpoint, differing configurations):
    # one line, not one per rank.
    from ringflash.train.checkpoint_files import CheckpointError, agreed

    def refuses(cfg):
        raise agreed(CheckpointError("checkpoint x has no manifest.json"))

    launch = _launch_script()
    monkeypatch.setattr(launch, "train", refuses)
    for key, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", 2)):
        monkeypatch.setenv(key, str(value))
    assert launch.main([], quiet_wait_s=0) == 2
    assert capsys.readouterr().err == said
