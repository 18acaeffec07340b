"""Run directories and resuming: the same command twice gives two runs; `--resume` resumes or fails
on every rank; a torchrun restart continues its own run, fresh if it saved nothing yet."""

from __future__ import annotations

import contextlib
import datetime
import io
import os

import pytest

from ringflash.train.checkpoint import CheckpointError
from ringflash.train.config import load_config
from ringflash.train.runs import resolve_run, runs
from tests.dist_utils import REPO, run_ranks
from tests.tiny_config import TINY
from tests.train.test_train import launch_script

# configs/tiny_cpu.toml (the README's first command), two steps and a few evaluation samples.
README_RUN = ["--config", str(REPO / "configs" / "tiny_cpu.toml"), "--train.steps=2", "--train.eval_every=0",
              "--data.eval_samples=4", "--logging.progress_bar=false"]  # fmt: skip


def _launch(rank, world, *argvs: list[str], env: dict[str, str] | None = None) -> list[tuple[int, str, str]]:
    """launch/train.py's main() on each argv in turn: exit code, stdout and stderr of each."""
    os.environ.update(env or {})
    cli, results = launch_script(), []
    for argv in argvs:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
        results.append((code, out.getvalue(), err.getvalue()))
    return results


def test_the_same_command_twice_gives_two_runs_and_resume_continues_the_latest(tmp_path):
    argv = [*README_RUN, f"--logging.dir={tmp_path}"]
    longer = [*argv, "--train.steps=3"]
    results = run_ranks(_launch, 2, args=(argv, argv, [*longer, "--resume"]), timeout_s=120)
    first, second, resumed = results[0]
    assert [r[0] for rank in results for r in rank] == [0] * 6, results
    one, two = runs(tmp_path)
    for run, (_, out, _) in zip((one, two), (first, second), strict=True):
        assert f"checkpoint of step 2: {run / 'checkpoints' / 'step_00000002'}" in out, out
        assert f"TensorBoard logs: {run / 'tb'}" in out, out
    # --resume: the latest run, continued in its own directory (checkpoint.keep = 1 there).
    assert f"resumed from {two / 'checkpoints' / 'step_00000002'} at step 2" in resumed[1], resumed
    assert [p.name for p in (two / "checkpoints").iterdir()] == ["step_00000003"]
    assert len(list(two.glob("tb/*/events.out.tfevents.*"))) == 2 and runs(tmp_path) == [one, two]
    # --resume RUN_DIR: that run's latest checkpoint.
    [(code, out, _)], _ = run_ranks(_launch, 2, args=([*longer, "--resume", str(one)],), timeout_s=120)
    assert code == 0 and f"resumed from {one / 'checkpoints' / 'step_00000002'} at step 2" in out, out
    assert (one / "checkpoints" / "step_00000003" / "manifest.json").is_file() and runs(tmp_path) == [one, two]


def test_resume_without_a_checkpoint_fails_on_every_rank(tmp_path):
    """Before, --resume in an empty or mistyped directory printed one line and trained from scratch."""
    empty = [*README_RUN, f"--logging.dir={tmp_path / 'empty'}", "--resume"]
    named = [*README_RUN, f"--logging.dir={tmp_path / 'named'}", "--logging.run_id=", "--resume"]
    typo = [*README_RUN, f"--logging.dir={tmp_path / 'x'}", "--resume", str(tmp_path / "no_such_run")]
    results = run_ranks(_launch, 2, args=(empty, named, typo), timeout_s=120)
    expected = [
        rf"--resume: no run in {tmp_path / 'empty'} holds a complete checkpoint",
        rf"checkpoint.resume = latest: no complete checkpoint in {tmp_path / 'named' / 'checkpoints'} to resume",
        rf"checkpoint.resume: {tmp_path / 'no_such_run'} is not a complete checkpoint",
    ]
    for rank, per_rank in enumerate(results):
        for (code, out, err), message in zip(per_rank, expected, strict=True):
            assert code == 2 and "step " not in out, (out, err)  # every rank stops before training
            if rank == 0:  # rank 0 prints the error, one line
                assert err.startswith("error: " + message) and len(err.splitlines()) == 1, err
    assert not (tmp_path / "empty").exists() and not any((tmp_path / "x").iterdir())  # no run left behind


def test_torchrun_restart_without_a_checkpoint_starts_its_run_fresh(tmp_path):
    [[(code, out, err)]] = run_ranks(
        _launch, 1, args=([*TINY, f"--logging.dir={tmp_path}", "--logging.run_id=auto", "--train.steps=1"],),
        kwargs={"env": {"TORCHELASTIC_RESTART_COUNT": "1"}}, timeout_s=60,
    )  # fmt: skip
    assert code == 0, err
    [run] = runs(tmp_path)
    assert f"no complete checkpoint in {run / 'checkpoints'} yet: starting this run fresh" in out, out
    assert (run / "checkpoints" / "step_00000001").is_dir()


def test_which_run_a_launch_continues(tmp_path):
    """resolve_run on one process, with the launcher and the clock given."""

    def resolve(resume: str, launch: str, *overrides: str):
        cfg = load_config(None, [f"--logging.dir={tmp_path}", f"--checkpoint.resume={resume}", *overrides])
        return resolve_run(cfg, 0, launch, datetime.datetime(2026, 11, 27, 9, 15))

    fresh = resolve("", "host:100")
    again = resolve("", "host:200")  # the same second: a run of its own
    assert (fresh.dir.name, again.dir.name) == ("20261127-091500", "20261127-091500-2")
    assert fresh.checkpoints == fresh.dir / "checkpoints" and fresh.resume == ""
    (fresh.checkpoints / "step_00000004").mkdir(parents=True)
    (fresh.checkpoints / "step_00000004" / ".metadata").touch()  # complete, as far as resolving goes
    # --resume: the latest run holding a checkpoint (the later one has none).
    assert resolve("latest", "host:300").dir == fresh.dir
    # A torchrun restart continues its own run, with or without a checkpoint, never another one.
    assert resolve("auto", "host:200").dir == again.dir
    assert resolve("auto", "host:100").dir == fresh.dir
    assert resolve("auto", "host:999").dir.name == "20261127-091500-3"
    # A path: a run's checkpoint continues in that run; a run directory resumes its latest.
    step = fresh.checkpoints / "step_00000004"
    assert resolve(str(step), "host:300").dir == fresh.dir
    by_dir = resolve(str(fresh.dir), "host:300")
    assert (by_dir.dir, by_dir.checkpoints, by_dir.resume) == (fresh.dir, fresh.checkpoints, "latest")
    # Named run directories and checkpoint.dir are used as given.
    assert resolve("", "host:300", "--logging.run_id=exp1").dir == tmp_path / "exp1"
    assert resolve("", "host:300", "--logging.run_id=").dir == tmp_path
    assert resolve("latest", "host:300", f"--checkpoint.dir={tmp_path / 'c'}").checkpoints == tmp_path / "c"
    with pytest.raises(CheckpointError, match=r"--resume: no run in .*empty holds a complete checkpoint"):
        resolve("latest", "host:300", f"--logging.dir={tmp_path / 'empty'}")


@pytest.mark.parametrize("run_id", ["a/b", "..", ".hidden"])
def test_run_id_is_a_directory_name(run_id):
    from ringflash.train.config import ConfigError

    with pytest.raises(ConfigError, match=r"logging.run_id: 'auto', '' or a directory name"):
        load_config(None, [f"--logging.run_id={run_id}"])
