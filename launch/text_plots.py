"""Held-out bits per byte of real-text runs: record a run into benchmarks/training.jsonl, plot the records.

    python launch/text_plots.py record runs/text_cpu/<run> --config configs/text_cpu.toml [--note ...] [-- OVERRIDES]
    python launch/text_plots.py plot      # docs/text_bpb.png from the newest record of each config

`record` reads the run's TensorBoard scalars (`heldout/bpb`, or `heldout/bits_per_token` for bin,
and the training `loss`) and counts the corpus the config reads (files and bytes of each part),
on the machine that ran it: the standard library differs a little between machines. `plot` draws
the newest record of each config, one panel each, from the records alone. Needs matplotlib and
tensorboard (the `dev` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

from ringflash.bench import BENCHMARKS_DIR, REPO, record
from ringflash.train.config import load_config
from ringflash.train.data import corpora

DOCS = REPO / "docs"
TAGS = ("heldout/bpb", "heldout/bits_per_token")


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    """Step -> value of one TensorBoard tag over every launch under `<run_dir>/tb` (later launches win)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for launch in sorted((run_dir / "tb").iterdir()):
        events = EventAccumulator(str(launch), size_guidance={"scalars": 0})
        events.Reload()
        if tag in events.Tags()["scalars"]:
            out |= {e.step: e.value for e in events.Scalars(tag)}
    return out


def record_run(run_dir: Path, config: str, overrides: list[str], note: str = "",
               directory: Path = BENCHMARKS_DIR) -> dict:  # fmt: skip
    cfg = load_config(REPO / config if not Path(config).is_absolute() else config, overrides)
    tag = TAGS[0] if cfg.data.kind == "text" else TAGS[1]
    held, loss = scalars(run_dir, tag), scalars(run_dir, "loss")
    if not held:
        raise SystemExit(f"{run_dir}: no {tag} scalars (was data.heldout set and logging.tensorboard on?)")
    train, heldout = corpora(cfg.data)
    unit = "bpb" if tag == TAGS[0] else "bits/token"
    rows = [[s, held[s], loss[s] / math.log(2) if s in loss else None] for s in sorted(held)]
    d = cfg.data
    args = {
        "config": config, "overrides": " ".join(overrides) or None, "cp": cfg.parallel.cp, "seq_len": d.seq_len,
        "batch_size": d.batch_size, "steps": cfg.train.steps, "data": d.path, "files": d.files,
        "python": platform.python_version(), "train files": train.files, "train bytes": train.bytes,
        "held-out files": heldout.files, "held-out bytes": heldout.bytes, "held-out sequences": d.eval_samples,
    }  # fmt: skip
    title = f"Real text: held-out {unit} of {config} ({d.path}, {d.seq_len:,}-token packed documents, cp = " \
            f"{cfg.parallel.cp})"  # fmt: skip
    notes = (f"Run directory {run_dir.name}. Train loss: the step's batch mean, in bits per token. " + note).strip()
    return record("training", title, ["step", f"held-out {unit}", "train loss (bits/token)"], rows, args=args,
                  notes=notes, directory=directory)  # fmt: skip


def newest_text_records(path: Path = BENCHMARKS_DIR / "training.jsonl") -> dict[str, dict]:
    """The newest record of each config that has a held-out curve, by config path, in file order."""
    out = {}
    for line in filter(str.strip, path.read_text().splitlines()):
        rec = json.loads(line)
        if any(k.startswith("held-out b") for k in (rec["results"] or [{}])[0]):
            out[rec["args"]["config"]] = rec  # a later line is a later run
    return out


def plot(out: Path = DOCS / "text_bpb.png", records: Path = BENCHMARKS_DIR / "training.jsonl") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = newest_text_records(records)
    if not recs:
        raise SystemExit("no real-text records in benchmarks/training.jsonl: run `record` first")
    fig, axes = plt.subplots(1, len(recs), figsize=(5.5 * len(recs), 3.8), squeeze=False)
    for ax, (config, rec) in zip(axes[0], recs.items()):
        rows = rec["results"]
        held_key = next(k for k in rows[0] if k.startswith("held-out b"))
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r[held_key] for r in rows], marker="o", label=held_key)
        trained = [r for r in rows if r["train loss (bits/token)"] is not None]
        ax.plot([r["step"] for r in trained], [r["train loss (bits/token)"] for r in trained], marker=".",
                alpha=0.6, label="train loss (bits/token)")  # fmt: skip
        a = rec["args"]
        ax.set_title(f"{config}: {a['train files']} files train, {a['held-out files']} held out\n"
                     f"{rec['device']}, {rec['date']}, {rec['commit']}", fontsize=9)  # fmt: skip
        ax.set_xlabel(f"step ({a['batch_size']} × {a['seq_len']:,} tokens)")
        ax.set_ylabel("bits")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="append a run's held-out curve to benchmarks/training.jsonl")
    rec.add_argument("run_dir", type=Path)
    rec.add_argument("--config", required=True, help="the config the run used, as given to launch/train.py")
    rec.add_argument("--note", default="", help="appended to the record's notes")
    rec.add_argument("overrides", nargs="*", help="the run's --section.key=value overrides (after --)")
    sub.add_parser("plot", help="draw docs/text_bpb.png from the records")
    args = parser.parse_args(argv)
    if args.cmd == "record":
        record_run(args.run_dir, args.config, args.overrides, args.note)
    else:
        plot()


if __name__ == "__main__":
    main(sys.argv[1:])
