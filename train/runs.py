"""Run directories: every launch of a configuration gets its own, `<logging.dir>/<run id>/`.

    runs/tiny_cpu/20261127-091500/tb/<launch>/    TensorBoard events of each launch of the run
    runs/tiny_cpu/20261127-091500/checkpoints/    step_00000800/ ...

`logging.run_id = "auto"` (the default) names a new run by its start time, so the same command
run twice gives two runs side by side. `--resume` (`checkpoint.resume = "latest"`) continues
the latest run of `logging.dir` that holds a complete checkpoint, in that run's directory;
`--resume PATH` a checkpoint (a run's own `checkpoints/step_N` continues in its run) or a run
directory. A torchrun restart (`"auto"`) continues the run its first attempt started, found by
the torchrun agent that launched both attempts, and starts it fresh if it has no checkpoint yet;
never an older run. A named `run_id`, or `""` (`logging.dir` itself is the run directory), and an
explicit `checkpoint.dir` are used as given: a new run there refuses checkpoints already in it.
"""

from __future__ import annotations

import datetime
import itertools
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ringflash.train.checkpoint import CheckpointError, complete_checkpoints
from ringflash.train.config import Config

AUTO = "auto"
_LAUNCH = ".launch"  # in each auto-named run: the launcher that started it (launch_id)


@dataclass
class Run:
    dir: Path  # TensorBoard events under dir/tb
    checkpoints: Path
    resume: str  # what Checkpointer.resolve reads: checkpoint.resume, or 'latest' for a run directory

    def remove_if_unused(self, is_main: bool) -> None:
        """Remove the run's directory if the run ended before writing anything into it (rank 0)."""
        if is_main and self.dir.is_dir() and {p.name for p in self.dir.iterdir()} <= {_LAUNCH}:
            (self.dir / _LAUNCH).unlink(missing_ok=True)
            self.dir.rmdir()


def launch_id() -> str:
    """The process that launched this one: under torchrun the agent, the same in every restarted
    attempt of one job and another in the next job."""
    return f"{socket.gethostname()}:{os.getppid()}"


def runs(base: Path) -> list[Path]:
    """The auto-named runs in `base`, oldest first."""
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if (p / _LAUNCH).is_file())


def resolve_run(cfg: Config, rank: int, launch: str | None = None, now: datetime.datetime | None = None) -> Run:
    """This launch's run: decided (and, if new, created) by rank 0 and the same on every rank, or the
    same CheckpointError on every rank. `launch` and `now` default to launch_id() and the clock."""
    run, error = None, None
    if rank == 0:
        try:
            run = _decide(cfg, launch or launch_id(), now or datetime.datetime.now())
        except CheckpointError as e:
            error = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [(run, error)]
        dist.broadcast_object_list(box, src=0)
        run, error = box[0]
    if error is not None:
        raise CheckpointError(error)
    return run


def _decide(cfg: Config, launch: str, now: datetime.datetime) -> Run:
    base, run_id, resume = Path(cfg.logging.dir), cfg.logging.run_id, cfg.checkpoint.resume
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    path = Path(resume) if resume not in ("", "latest", AUTO) and ckpt_dir is None else None
    if run_id != AUTO:
        run_dir = base / run_id if run_id else base
    elif resume == "latest" and ckpt_dir is None:
        held = [r for r in runs(base) if complete_checkpoints(r / "checkpoints")]
        if not held and not complete_checkpoints(base / "checkpoints"):  # nor a run from before run ids
            raise CheckpointError(
                f"--resume: no run in {base} holds a complete checkpoint (looked in {base}/*/checkpoints/); "
                "start without --resume for a new run, or pass --resume PATH"
            )
        run_dir = held[-1] if held else base
    elif resume == AUTO:
        mine = [r for r in runs(base) if (r / _LAUNCH).read_text().strip() == launch]
        run_dir = mine[-1] if mine else _new_run(base, launch, now)
    elif path is not None and (path / _LAUNCH).is_file():
        return Run(path, path / "checkpoints", "latest")  # a run directory: its latest checkpoint
    elif path is not None and path.parent.name == "checkpoints" and (path.parent.parent / _LAUNCH).is_file():
        run_dir = path.parent.parent  # a run's own checkpoint: the run continues in its directory
    else:
        run_dir = _new_run(base, launch, now)
    return Run(run_dir, ckpt_dir or run_dir / "checkpoints", resume)


def _new_run(base: Path, launch: str, now: datetime.datetime) -> Path:
    stamp = now.strftime("%Y%m%d-%H%M%S")
    for n in itertools.count(1):
        run_dir = base / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            run_dir.mkdir(parents=True)  # not exist_ok: two launches in one second get two runs
        except FileExistsError:
            continue
        except OSError as e:
            raise CheckpointError(f"logging.dir: cannot create the run directory {run_dir}: {e}") from None
        (run_dir / _LAUNCH).write_text(launch + "\n")
        return run_dir
    raise AssertionError("unreachable")
