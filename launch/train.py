"""Train the ringflash LM: `torchrun --nproc_per_node=N launch/train.py --config configs/X.toml`.

Any option can be overridden as `--section.key=value` (see `--help`). Each launch is a new run in
its own directory, `<logging.dir>/<start time>/`; `--resume` continues the latest run of
`logging.dir` from its latest complete checkpoint (`--resume PATH`: a given checkpoint or run), or
fails if there is none.

Fault tolerance: under `torchrun --max-restarts=N` a restarted attempt (TORCHELASTIC_RESTART_COUNT
> 0) continues the run its first attempt started from the latest complete checkpoint by itself
(fresh if none was saved yet), so a killed rank costs at most the steps since the last save (set
`--checkpoint.interval`). Exit codes: 2 configuration or checkpoint
error, 3 non-finite loss, 4 communication failure (a peer rank died, hung past
`parallel.timeout_s`, or skipped a collective): each rank prints its own one-line error.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from ringflash.train.config import ConfigError, describe, load_config
from ringflash.train.trainer import NonFiniteLossError, train


def main(argv: list[str] | None = None) -> int:
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
    try:
        cfg = load_config(args.config, overrides)
        result = train(cfg)
    except (ConfigError, NonFiniteLossError) as e:
        # Every rank raises the same error; one clear line instead of N tracebacks.
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 3
    except RuntimeError as e:
        if not _is_comm_failure(e):
            raise
        # Each rank sees its own side of it (a timeout here, a closed connection there).
        print(
            f"error: rank {rank}: communication failed: {_first_line(e)}. A peer rank died, hung longer than "
            f"parallel.timeout_s, or skipped a collective; see the first rank that failed.",
            file=sys.stderr,
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


def _is_comm_failure(e: RuntimeError) -> bool:
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return True
    return bool(re.search(r"gloo|nccl|Timed out|Connection closed|Connection reset|Broken pipe", str(e)))


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


if __name__ == "__main__":
    sys.exit(main())
