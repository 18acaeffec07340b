"""Train the ringflash LM: `torchrun --nproc_per_node=N launch/train.py --config configs/X.toml`.

Any option can be overridden as `--section.key=value` (see `--help`); `--resume` continues the
latest complete checkpoint of the run (or `--resume PATH` a given one).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# This script shares its name with the `train` package and Python puts launch/ first on the path,
# where `import train` would find this file: put the repository root there instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from train.config import ConfigError, describe, load_config  # noqa: E402
from train.trainer import NonFiniteLossError, train  # noqa: E402


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
        help="continue the latest complete checkpoint, or the one at PATH",
    )
    args, overrides = parser.parse_known_args(argv)
    if args.resume is not None:
        overrides.append(f"--checkpoint.resume={args.resume}")
    rank0 = int(os.environ.get("RANK", 0)) == 0
    try:
        cfg = load_config(args.config, overrides)
        result = train(cfg)
    except (ConfigError, NonFiniteLossError) as e:
        # Every rank raises the same error; one clear line instead of N tracebacks.
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 3
    if rank0 and result.losses:
        first, last = result.losses[min(result.losses)], result.losses[max(result.losses)]
        print(f"done: step {result.final_step}, loss {first:.4f} -> {last:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
