"""Train the ringflash LM: `torchrun --nproc_per_node=N launch/train.py --config configs/X.toml`.

Any option can be overridden as `--section.key=value` (see `--help`). Each launch is a new run in
its own directory, `<logging.dir>/<start time>/`; `--resume` continues the latest run of
`logging.dir` from its latest complete checkpoint (`--resume PATH`: a given checkpoint or run), or
fails if there is none.

Fault tolerance: under `torchrun --max-restarts=N` a restarted attempt (TORCHELASTIC_RESTART_COUNT
> 0) continues the run its first attempt started from the latest complete checkpoint by itself
(fresh if none was saved yet), so a killed rank costs at most the steps since the last save (set
`--checkpoint.interval`). Exit codes: 2 configuration or checkpoint error (or another ValueError
or TypeError the library raises on bad input), 3 non-finite loss, 4 communication failure (a peer
rank died, hung past `parallel.timeout_s`, or skipped a collective). An error in the configuration
itself (the file, the overrides, their checks against the world size) is one line, `error: ...`,
from rank 0 alone: every rank reads the same arguments and finds the same mistake. So is a later
error the ranks agreed on (a checkpoint they cannot resume, configurations that differ, data a
rank cannot read); any other is one line per rank, `rank N: error: ...`, since each rank sees its
own side of it. The line comes before torchrun's report (which torchrun prints whenever a rank
exits non-zero). Any other exception keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

from ringflash.bench import exit_without_teardown
from ringflash.train.config import ConfigError, describe, load_config
from ringflash.train.trainer import NonFiniteLossError, train


def main(argv: list[str] | None = None, quiet_wait_s: float = 30.0) -> int:
    """The launch; `quiet_wait_s`: how long a rank that leaves a configuration error to another
    waits before exiting (torchrun ends the wait sooner, when the speaking rank exits)."""
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="options (--section.key=value):\n" + describe(),
    )
    parser.add_argument("--config", help="TOML file; omitted keys keep their defaults")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="continue the latest run of logging.dir from its latest checkpoint, or the checkpoint or run at PATH",
    )
    args, overrides = parser.parse_known_args(argv)
    rank = int(os.environ.get("RANK", 0))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if args.resume is None and restart > 0:
        # torchrun restarted the job after a failure: this is the same run, not a new one. Unlike
        # an explicit --resume ("latest", which must find a checkpoint), "auto" starts the run
        # fresh if its first attempt saved none yet.
        args.resume = "auto"
        if rank == 0:
            print(f"torchrun restart {restart}: continuing this run from its latest complete checkpoint", flush=True)
    if args.resume is not None:
        overrides.append(f"--checkpoint.resume={args.resume}")
    # One line per rank, each naming itself when there are several: "rank 1: error: ...".
    who = f"rank {rank}: " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    try:
        cfg = load_config(args.config, overrides, world_size=_world_size())
    except ConfigError as e:
        # The same arguments, files and environment give every rank of a node the same error: its
        # first rank says it. On another node the files may differ, so that node's first rank
        # speaks too, rather than an error of its own going unsaid.
        return _said_once(e, rank, int(os.environ.get("LOCAL_RANK", rank)) == 0, quiet_wait_s)
    try:
        result = train(cfg)
    except (ConfigError, NonFiniteLossError, ValueError, TypeError) as e:
        if not isinstance(e, (ConfigError, NonFiniteLossError)) and not _raised_by_library(e):
            raise  # a bug, not bad input: its traceback is what helps
        if getattr(e, "agreed", False):  # every rank raised this very error, after comparing notes
            return _said_once(e, rank, rank == 0, quiet_wait_s)
        _say(f"{who}error: {_one_line(e)}")
        return 3 if isinstance(e, NonFiniteLossError) else 2
    except RuntimeError as e:
        if not _is_comm_failure(e):
            raise
        # Each rank sees its own side of it (a timeout here, a closed connection there).
        _say(
            f"{who}error: communication failed: {_first_line(e)}. A peer rank died, hung longer than "
            f"parallel.timeout_s, or skipped a collective; see the first rank that failed."
        )
        return 4
    if rank == 0 and result.losses:
        first, last = result.losses[min(result.losses)], result.losses[max(result.losses)]
        print(f"done: step {result.final_step}, loss {first:.4f} -> {last:.4f}")
    elif rank == 0:
        # Resumed at (or past) where it stops: the trainer ran no step, evaluation or save.
        t = cfg.train
        key, value = ("train.steps", t.steps) if result.final_step >= t.steps else ("train.stop_at", t.stop_at)
        print(f"done: step {result.final_step}, the run is already at {key} = {value}: nothing to do")
    return 0


def _said_once(e: Exception, rank: int, speaks: bool, quiet_wait_s: float) -> int:
    """An error every rank has, said by the rank that `speaks` (rank 0 unnamed); the others stay quiet."""
    if speaks:
        _say(f"{f'rank {rank}: ' if rank else ''}error: {_one_line(e)}")
    else:
        # torchrun stops every rank once one exits: a quiet rank that exited first would stop the
        # one about to speak. It waits instead, and torchrun ends the wait when that one exits.
        time.sleep(quiet_wait_s)
    return 2


def _world_size() -> int:
    """The job's world size, checked against the configuration before anything follows from it:
    the process group's where one exists already (a test harness's, which `distributed` then
    uses), else torchrun's WORLD_SIZE (1 without torchrun)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def _is_comm_failure(e: RuntimeError) -> bool:
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return True
    return bool(re.search(r"gloo|nccl|Timed out|Connection closed|Connection reset|Broken pipe", str(e)))


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _say(line: str) -> None:
    """The error `line` to stderr in one write (the ranks share torchrun's stream, and print's
    separate write of the newline let another rank's line in before it), and to torchrun's error
    file for this rank, so that torchrun's report names it instead of a link to its docs."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):  # the line is out already; the report is a courtesy
            # torchelastic's own layout (ErrorHandler.record_exception), without the traceback.
            report = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
            Path(error_file).write_text(json.dumps(report))


def _one_line(e: BaseException) -> str:
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


def _raised_by_library(e: BaseException) -> bool:
    """Whether ringflash's own code raised `e` (its input checks), not torch's or Python's."""
    import ringflash
    import ringflash.kernels
    import ringflash.train

    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    raised_in = Path(tb.tb_frame.f_code.co_filename).resolve()
    roots = [Path(m.__file__).resolve().parent for m in (ringflash, ringflash.kernels, ringflash.train)]
    return any(raised_in.is_relative_to(root) for root in roots)


if __name__ == "__main__":
    # main() has destroyed its process groups and closed its logs and checkpoints by now; on gloo
    # the interpreter's teardown after that still aborts a rank now and then (SIGABRT), which
    # would fail a finished run (docs/RELIABILITY.md).
    exit_without_teardown(main())
