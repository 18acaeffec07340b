"""The GPU acceptance run's judgement (launch/gpu_acceptance.sh calls it): did a training run's loss
fall, does the ring's loss curve equal one GPU's, and what makes a config's loss judgeable in a few
steps. Everything here runs on CPU too (tests/launch/test_acceptance.py).

    python launch/acceptance.py overrides CONFIG STEPS     # the run's overrides for CONFIG, one a line
    python launch/acceptance.py summary LOG EXIT_CODE      # a training log judged: one JSON line
    python launch/acceptance.py parity --config C --world W --steps N --logdir D [--record-to DIR] [-- OVERRIDES]
    python launch/acceptance.py plot                       # the newest parity record: docs/parity.png

The rule (`judge`): a run passes when its loss over all tokens falls by more than its step-to-step
noise and no step after the first returns above the first step's loss. The parity rule (`parity`):
cp = W's loss at every step within 1% of the first step's loss of cp = 1's, with the same kernels,
config, seed and data, and cp = 1's curve passing `judge` (parity of a curve that does not fall
shows nothing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
MIN_STEPS = 4  # two halves of at least two steps each
PARITY_TOLERANCE = 0.01  # of the first step's loss; bf16's drift between cp = 2 and cp = 1 stayed under 1%
# The trainer's summary line, `log_every = 1` (train/trainer.py).
STEP_LINE = re.compile(
    r"step +(\d+) \| loss ([\d.]+|nan|inf) \| lr \S+ \| grad norm \S+ \| ([\d,]+) tok/s \| ([\d.]+) TFLOP/s"
    r"(?: \| MFU ([\d.]+)%)? \| peak mem ([\d.]+) GiB"
)


# The trainer's held-out line (train/heldout.py), text and bin data with `data.heldout` > 0.
HELDOUT_LINE = re.compile(r"step +(\d+) \| held-out ([\d.]+|nan|inf) (?:bpb|bits/token)")
HELDOUT_SAMPLES = 2  # held-out sequences scored after every step of an acceptance run


class Verdict(NamedTuple):
    passed: bool
    reason: str


def judge(losses: Sequence[float]) -> Verdict:
    """Whether a loss curve shows training, one loss per step (all tokens, the global mean).

    It passes when both hold:
    - the loss falls by more than its noise: the mean of the first half of the steps minus the
      mean of the last half (the middle step, for an odd count, in neither) exceeds the noise,
      the median of |loss[i+1] - loss[i]| over successive steps. The median is not moved by one
      spike; the differences include the trend, so on a curve that falls steadily the noise is
      overstated and the rule errs towards failing. Flat curves of independent noise pass both
      conditions 5% of the time over 6 steps, 1% over 12 (tests/launch/test_acceptance.py).
    - no step after the first returns above the first step's loss (a spike back to the start
      is a run that lost what it learned, whatever its mean does).
    Fewer than MIN_STEPS losses, or a non-finite one, fail.
    """
    n = len(losses)
    if n < MIN_STEPS:
        return Verdict(False, f"{n} losses: at least {MIN_STEPS} are needed to judge a curve")
    if not all(math.isfinite(x) for x in losses):
        return Verdict(False, f"a non-finite loss: {list(losses)}")
    half = n // 2
    fall = statistics.fmean(losses[:half]) - statistics.fmean(losses[n - half :])
    noise = statistics.median(abs(b - a) for a, b in itertools.pairwise(losses))
    curve = f"loss {losses[0]:.4g} -> {losses[-1]:.4g} over {n} steps"
    problems = []
    above = [i + 1 for i, x in enumerate(losses[1:], 1) if x > losses[0]]
    if above:
        problems.append(f"step {above[0]} ({losses[above[0] - 1]:.4g}) is above step 1's {losses[0]:.4g}")
    if not fall > noise:
        problems.append(f"the fall {fall:.3g} (first {half} steps' mean minus the last {half}'s) is not above "
                        f"the noise {noise:.3g} (median |step-to-step change|)")  # fmt: skip
    if problems:
        return Verdict(False, f"{curve}: " + "; ".join(problems))
    return Verdict(True, f"{curve}: falls {fall:.3g}, noise {noise:.3g}, never above step 1")


def parity(reference: Sequence[float], ring: Sequence[float], tolerance: float = PARITY_TOLERANCE) -> Verdict:
    """cp = W's curve `ring` against cp = 1's `reference`: every step within `tolerance` times the
    reference's first loss, the same number of steps, and `reference` passing `judge`."""
    if len(ring) != len(reference):
        return Verdict(False, f"cp = 1 logged {len(reference)} steps, the ring {len(ring)}")
    learns = judge(reference)
    if not learns.passed:
        return Verdict(False, f"cp = 1's curve does not show training ({learns.reason})")
    bound = tolerance * reference[0]
    gaps = [abs(a - b) for a, b in zip(reference, ring)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    where = f"largest gap {gaps[worst]:.3g} at step {worst + 1} ({ring[worst]:.4g} against {reference[worst]:.4g})"
    if not gaps[worst] <= bound:
        return Verdict(False, f"{where} exceeds {tolerance:g} of the first loss, {bound:.3g}")
    return Verdict(True, f"{where}, within {tolerance:g} of the first loss ({bound:.3g}); mean gap "
                         f"{statistics.fmean(gaps):.3g}")  # fmt: skip


def logged_steps(log: str) -> list[tuple[str, ...]]:
    """The trainer's per-step lines of `log` as (step, loss, tok/s, TFLOP/s, MFU or '', peak GiB)."""
    return STEP_LINE.findall(log)


def heldout_curve(log: str) -> list[float]:
    """The held-out scores of `log`, one per evaluation (step 0 first), the last of a step that was
    scored twice (at the end as well as every `eval_every`)."""
    return list({int(step): float(bits) for step, bits in HELDOUT_LINE.findall(log)}.values())


def summary(log: str, exit_code: int) -> dict:
    """A training step of the acceptance run: every loss, `judge`'s verdict, and the last logged
    step's throughput (steady state, past the first step's compile and autotune). A run that scored
    held-out data after every step is judged on that curve: the same sequences each time, where a
    training batch of other text (another language, a table of escapes) can score above the first
    one after two steps that learnt only the first batches' bytes."""
    steps = logged_steps(log)
    losses = [float(s[1]) for s in steps]
    heldout = heldout_curve(log)
    judged = heldout if len(heldout) > len(losses) else losses
    verdict = judge(judged)
    if exit_code != 0:
        status = f"FAIL (exit {exit_code}; {verdict.reason})"
    else:
        status = "PASS" if verdict.passed else f"FAIL ({verdict.reason})"
    out: dict = {"losses": losses, "status_line": status, "judged": verdict.reason}
    if judged is heldout:
        out |= {"held-out": heldout, "judged": f"held-out {verdict.reason}"}
    if steps:
        last = steps[-1]
        out.update({"tok/s": int(last[2].replace(",", "")), "model TFLOP/s per GPU": float(last[3]),
                    "MFU %": float(last[4]) if last[4] else None, "peak GiB per GPU": float(last[5])})  # fmt: skip
    return out


def acceptance_overrides(config: str | Path, steps: int) -> list[str]:
    """What makes CONFIG's loss judgeable in `steps` steps, beside the config's own settings:
    - the loss on every token (`data.passkey_loss = all`; text and token files have no other):
      the passkey digits alone are a handful of tokens a step, whose loss is mostly noise;
    - text and token files with held-out data scored after every step on HELDOUT_SAMPLES fixed
      sequences, the curve `summary` judges; no other evaluation (passkey accuracy is slow and
      needs hundreds of steps);
    - the config's own first ten steps: the lr rises as the config's warm-up makes it rise, to
      what it reaches by step 10 (the learning-rate bound's quantity, so within what trains at its
      width), and holds there instead of climbing through a warm-up of hundreds of steps the run
      never leaves. A steeper ramp to the same peak is not the config's: at 2.5 times its slope,
      configs/gpu2_text.toml's loss spiked above a uniform guess (docs/RELIABILITY.md).
    """
    from ringflash.train.config import load_config
    from ringflash.train.lr_bound import EARLY_STEPS, early_lr

    if steps < MIN_STEPS:
        raise ValueError(f"steps must be at least {MIN_STEPS} to judge a loss curve, got {steps}")
    cfg = load_config(config)
    out = []
    if cfg.data.kind == "passkey":
        out.append("--data.passkey_loss=all")
    elif cfg.data.kind == "recall":
        raise ValueError(f"{config}: data.kind = recall takes its loss on the answer only, which the rule cannot judge")
    if cfg.data.kind in ("text", "bin") and cfg.data.heldout > 0:
        out += ["--train.eval_every=1", f"--data.eval_samples={HELDOUT_SAMPLES}"]
    else:
        out.append("--data.eval_samples=0")
    warmup = min(cfg.train.warmup_steps, EARLY_STEPS)
    out += [f"--train.lr={early_lr(cfg.train):.6g}", f"--train.warmup_steps={warmup}"]
    return out


def _torchrun(nproc: int, config: str, overrides: Sequence[str], log: Path) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "launch" / "train.py"), "--config", config, *overrides]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with log.open("w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    return rc, log.read_text()


def run_parity(config: str, world: int, steps: int, logdir: Path, overrides: Sequence[str] = (),
               record_to: Path | None = None) -> dict:  # fmt: skip
    """Train CONFIG at cp = 1 on one process, then at cp = `world` on `world`, with the same
    overrides (the acceptance run's, then `overrides`), `steps` steps each; judge with `parity`;
    record both curves (benchmarks/training.jsonl's schema) in `record_to`/training.jsonl if given.
    Returns the step's row for the acceptance record, with `status_line`."""
    from ringflash.bench import record

    if world < 2:
        raise ValueError(f"world must be at least 2 to compare the ring with one process, got {world}")
    logdir.mkdir(parents=True, exist_ok=True)
    common = [*acceptance_overrides(config, steps), f"--train.steps={steps}", "--logging.log_every=1",
              "--logging.tensorboard=false", "--logging.progress_bar=false", "--checkpoint.enabled=false",
              "--data.eval_samples=0", *overrides]  # fmt: skip
    curves, codes = {}, {}
    for cp in (1, world):
        run = [*common, f"--parallel.cp={cp}", f"--logging.dir={logdir / f'runs_cp{cp}'}"]
        codes[cp], log = _torchrun(cp, config, run, logdir / f"parity_cp{cp}.log")
        curves[cp] = [float(s[1]) for s in logged_steps(log)]
    verdict = parity(curves[1], curves[world])
    failed = {cp: rc for cp, rc in codes.items() if rc != 0}
    if failed:
        status = "FAIL (" + ", ".join(f"cp = {cp} exit {rc}" for cp, rc in failed.items()) + ")"
    else:
        status = "PASS" if verdict.passed else f"FAIL ({verdict.reason})"
    if record_to is not None and curves[1] and curves[world]:
        first = curves[1][0]
        rows = [[s + 1, a, b, abs(a - b) / first] for s, (a, b) in enumerate(zip(curves[1], curves[world]))]
        record("training", f"Loss parity: {Path(config).stem} at cp = {world} against cp = 1, {steps} steps",
               ["step", "loss cp = 1", f"loss cp = {world}", "|gap| / first loss"], rows,
               args={"config": config, "world": world, "steps": steps, "overrides": " ".join(common)},
               notes=f"launch/acceptance.py parity: {status}. {verdict.reason}. The same config, seed, data and "
                     f"kernels; the rule: every step within {PARITY_TOLERANCE:g} of cp = 1's first loss.",
               directory=record_to)  # fmt: skip
    return {"status_line": status, "judged": verdict.reason, "config": config, "overrides": " ".join(common),
            **{f"losses cp = {cp}": " ".join(f"{x:.4f}" for x in curve) for cp, curve in curves.items()}}  # fmt: skip


def plot_parity(records: Path, out: Path) -> Path:
    """The newest loss-parity record of `records` (a training.jsonl) drawn: both curves, and their
    gap as a share of the first loss against the 1% bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    parity = [r for r in rows if r["title"].startswith("Loss parity:")]
    if not parity:
        raise SystemExit(f"{records}: no loss-parity record")
    rec = parity[-1]
    steps = [r["step"] for r in rec["results"]]
    ring_key = next(k for k in rec["results"][0] if k.startswith("loss cp = ") and k != "loss cp = 1")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(3, 2))
    top.plot(steps, [r["loss cp = 1"] for r in rec["results"]], "o-", label="cp = 1 (one GPU)")
    top.plot(steps, [r[ring_key] for r in rec["results"]], "x--", label=ring_key.removeprefix("loss ") + " (ring)")
    top.set_ylabel("loss")
    top.legend()
    top.set_title(f"{rec['title']}\n{rec['device']}, {rec['date']}, {rec['commit']}", fontsize=9)
    bottom.semilogy(steps, [max(r["|gap| / first loss"], 1e-7) for r in rec["results"]], "o-")
    bottom.axhline(PARITY_TOLERANCE, color="red", linestyle=":", label=f"bound ({PARITY_TOLERANCE:.0%})")
    bottom.set_ylabel("|gap| / first loss")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    o = sub.add_parser("overrides", help="the acceptance run's overrides for a config, one a line")
    o.add_argument("config")
    o.add_argument("steps", type=int)
    s = sub.add_parser("summary", help="a training log judged, as one JSON line")
    s.add_argument("log", type=Path)
    s.add_argument("exit_code", type=int)
    p = sub.add_parser("parity", help="cp = world against cp = 1; exit 0 when they agree")
    p.add_argument("--config", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--logdir", type=Path, required=True)
    p.add_argument("--record-to", type=Path, default=None, help="directory whose training.jsonl gets the record")
    p.add_argument("overrides", nargs="*", help="after --: more --section.key=value for both runs")
    d = sub.add_parser("plot", help="the newest loss-parity record drawn (docs/parity.png)")
    d.add_argument("--records", type=Path, default=REPO / "benchmarks" / "training.jsonl")
    d.add_argument("--out", type=Path, default=REPO / "docs" / "parity.png")
    args = ap.parse_args(argv)
    if args.command == "plot":
        print(f"plot: {plot_parity(args.records, args.out)}")
        return 0
    if args.command == "overrides":
        print("\n".join(acceptance_overrides(args.config, args.steps)))
        return 0
    if args.command == "summary":
        print(json.dumps(summary(args.log.read_text(), args.exit_code)))
        return 0
    row = run_parity(args.config, args.world, args.steps, args.logdir, args.overrides, args.record_to)
    print(json.dumps(row))
    return 0 if row["status_line"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
