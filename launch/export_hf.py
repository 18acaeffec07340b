"""Export a `[model] kind = "hf"` training checkpoint for transformers (`save_pretrained`):

    python launch/export_hf.py --checkpoint runs/X/RUN/checkpoints/step_00000100 --out runs/X/RUN/hf
    AutoModelForCausalLM.from_pretrained("runs/X/RUN/hf")      # then loads it, no ringflash needed

One process, no torchrun: the checkpoint's shards are read whatever world size wrote them. Its
checksums (manifest.json) are verified first (without them it is refused, unless
`--trust-unverified`), and nothing in it is unpickled but plain data.
"""

from __future__ import annotations

import argparse
import sys

from ringflash.train.config import ConfigError
from ringflash.train.hf_model import export_pretrained


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a complete checkpoint directory (step_XXXXXXXX)")
    parser.add_argument("--out", required=True, help="the directory to write (config.json, model.safetensors)")
    parser.add_argument(
        "--trust-unverified",
        action="store_true",
        help="export a checkpoint without manifest.json (no checksums to verify it), else refused",
    )
    args = parser.parse_args(argv)
    try:
        out = export_pretrained(args.checkpoint, args.out, warn=lambda msg: print(msg, file=sys.stderr),
                                trust_unverified=args.trust_unverified)  # fmt: skip
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
