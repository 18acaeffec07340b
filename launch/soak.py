"""Soak: 2-rank CPU training under torchrun, with periodic checkpoints and two injected kills.

    python launch/soak.py                  # 2000 steps, a checkpoint every 200: ~4 minutes on 2 CPU cores
    python launch/soak.py --steps 200 --interval 25 --kill-step 60 --save-kill-step 150   # a quick one

Faults (torchrun gets `--max-restarts` = the number of faults, and every restart resumes the
latest complete checkpoint, see launch/train.py):
1. External: once rank 0 has logged step `--kill-step`, this script SIGKILLs the worker of rank
   `--kill-rank` (mid-step, between two checkpoints: the steps since the last one are lost and
   replayed).
2. In a save: `RINGFLASH_FAULT=save:S:R:1` makes rank R of the first restarted attempt SIGKILL
   itself while it writes checkpoint S, after its shards are on disk and before the checkpoint
   is published (train/checkpoint.py). The next attempt must ignore that partial checkpoint and
   resume from the one before.

Checks, printed and written to `<run-dir>/soak.json`: torchrun exits 0 after exactly the
injected number of restarts; each restart resumed from the checkpoint it should have; every step
1..N has a logged loss (the curve is continuous); steps replayed after a resume logged the same
loss as the first time; and (unless `--no-reference`) the final checkpoint (model, optimizer,
RNG) equals an uninterrupted run's bit for bit, and so does every logged loss. The loss curve
goes to `<run-dir>/loss.csv` (and `loss.png` with matplotlib). Not part of CI; a small version
of the same run is tests/train/test_reliability.py::test_torchrun_restart_resumes_bit_exact.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# A model that learns visibly in a few hundred steps and runs a step in tens of milliseconds.
MODEL = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=2",
    "--model.n_kv_heads=1",
    "--data.seq_len=256",
    "--data.batch_size=4",
    "--data.passkey_loss=all",
    "--data.eval_buckets=2",
    "--data.eval_samples=0",
    "--train.device=cpu",
    "--train.warmup_steps=20",
]

_STEP = re.compile(r"^step\s+(\d+) \| loss (\S+)")
_RESUMED = re.compile(r"^resumed from (\S+) at step (\d+)")


def train_overrides(run_dir: Path, steps: int, interval: int, timeout_s: float = 60.0) -> list[str]:
    """The command-line overrides of one soak training run (cp = 2 over the 2 ranks)."""
    return [
        *MODEL,
        "--parallel.cp=2",
        f"--parallel.timeout_s={timeout_s}",
        f"--train.steps={steps}",
        "--checkpoint.enabled=true",
        f"--checkpoint.interval={interval}",
        "--checkpoint.keep=2",
        f"--logging.dir={run_dir}",
        "--logging.run_id=",  # run_dir itself: final_checkpoint looks in run_dir/checkpoints
        "--logging.log_every=1",
        "--logging.progress_bar=false",
        "--logging.tensorboard=false",
    ]


def worker_pids(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of the workers torchrun (process `agent_pid`) runs now (Linux /proc)."""
    children = []
    for task in Path(f"/proc/{agent_pid}/task").glob("*"):
        try:
            children += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    ranks = {}
    for pid in children:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                ranks[int(item[5:])] = pid
    return ranks


def run_torchrun(
    overrides: list[str],
    *,
    max_restarts: int = 0,
    kill_step: int = 0,
    kill_rank: int = 1,
    fault: str = "",
    log=None,
    timeout_s: float = 3600,
) -> dict:
    """Run launch/train.py on 2 CPU ranks under torchrun, SIGKILLing rank `kill_rank` once rank 0
    has logged step `kill_step` (0: never), with `RINGFLASH_FAULT=fault`. Returns what happened:
    exit code, losses logged per step (a list each: a replayed step appears twice), resumes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RINGFLASH_FAULT": fault}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5",
        str(REPO / "launch" / "train.py"),
        *overrides,
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    losses: dict[int, list[float]] = {}
    resumes: list[tuple[str, int]] = []
    kills: list[dict] = []
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if log is not None:
                log.write(line)
            if m := _STEP.match(line):
                step = int(m.group(1))
                losses.setdefault(step, []).append(float(m.group(2)))
                if kill_step and step >= kill_step and not kills:
                    pids = worker_pids(proc.pid)
                    if kill_rank in pids:
                        os.kill(pids[kill_rank], signal.SIGKILL)
                        kills.append({"kind": "SIGKILL from outside", "rank": kill_rank, "after_step": step})
            elif m := _RESUMED.match(line):
                resumes.append((m.group(1), int(m.group(2))))
            if time.monotonic() - t0 > timeout_s:
                proc.kill()
                break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return {
        "returncode": proc.returncode,
        "losses": losses,
        "resumes": resumes,
        "kills": kills,
        "restarts": sum("torchrun restart" in line for line in lines),
        "wall_s": time.monotonic() - t0,
        "tail": "".join(lines[-40:]),
    }


def final_checkpoint(run_dir: Path) -> Path:
    from ringflash.train.checkpoint import complete_checkpoints

    found = complete_checkpoints(run_dir / "checkpoints")
    if not found:
        raise FileNotFoundError(f"no complete checkpoint in {run_dir / 'checkpoints'}")
    return found[-1]


def checkpoint_differences(a: Path, b: Path) -> list[str]:
    """Entries (model, optimizer, RNG; not the training-state blob with its paths) that differ."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def flat(prefix, x, out):
        if isinstance(x, dict):
            for k, v in x.items():
                flat(f"{prefix}.{k}" if prefix else str(k), v, out)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                flat(f"{prefix}.{i}", v, out)
        else:
            out[prefix] = x
        return out

    loaded = []
    for path in (a, b):
        out = path.with_name(path.name + ".pt")
        dcp_to_torch_save(path, out)
        state = torch.load(out, weights_only=True)  # tensors and plain data: nothing that runs code
        out.unlink()
        state.pop("train", None)
        loaded.append(flat("", state, {}))
    x, y = loaded
    differ = sorted(set(x) ^ set(y))
    for key in sorted(set(x) & set(y)):
        u, v = x[key], y[key]
        same = torch.equal(u, v) if isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) else u == v
        if not same:
            differ.append(key)
    return differ


def continuity(losses: dict[int, list[float]], steps: int) -> dict:
    """Missing steps, replayed steps, and replayed steps whose losses differ."""
    missing = [s for s in range(1, steps + 1) if s not in losses]
    replayed = sorted(s for s, v in losses.items() if len(v) > 1)
    mismatched = [s for s in replayed if len(set(losses[s])) > 1]
    return {"missing": missing, "replayed": len(replayed), "replay_mismatches": mismatched}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--interval", type=int, default=200, help="checkpoint every N steps")
    p.add_argument("--kill-step", type=int, default=None, help="external SIGKILL after this step (default ~0.3·steps)")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--save-kill-step", type=int, default=None, help="die while saving this step (default ~0.7·steps)")
    p.add_argument("--save-kill-rank", type=int, default=0)
    p.add_argument("--run-dir", default="runs/soak")
    p.add_argument("--no-reference", action="store_true", help="skip the uninterrupted reference run")
    args = p.parse_args(argv)

    n, k = args.steps, args.interval
    kill_step = args.kill_step if args.kill_step is not None else (int(0.3 * n) // k) * k + k // 2
    save_kill = args.save_kill_step if args.save_kill_step is not None else max(k, (int(0.7 * n) // k) * k)
    if save_kill and (save_kill % k or save_kill <= kill_step):
        p.error("--save-kill-step must be a checkpoint step after --kill-step")
    run_dir = (REPO / args.run_dir).resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        if not (run_dir / "soak.log").is_file():  # only ever delete a previous soak's directory
            p.error(f"--run-dir {run_dir} exists and is not a soak run directory")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fault = f"save:{save_kill}:{args.save_kill_rank}:1" if save_kill else ""
    n_faults = 1 + bool(save_kill)

    print(f"soak: {n} steps, checkpoint every {k}; SIGKILL rank {args.kill_rank} after step {kill_step}", end="")
    print(f"; rank {args.save_kill_rank} dies saving step {save_kill} in attempt 1" if save_kill else "")
    with open(run_dir / "soak.log", "w") as log:
        run = run_torchrun(
            train_overrides(run_dir / "soaked", n, k),
            max_restarts=n_faults,
            kill_step=kill_step,
            kill_rank=args.kill_rank,
            fault=fault,
            log=log,
        )
    expected_resumes = [(kill_step // k) * k] + ([save_kill - k] if save_kill else [])
    summary = {
        "steps": n,
        "interval": k,
        "faults_injected": len(run["kills"]) + bool(save_kill),
        "kills": run["kills"]
        + ([{"kind": "SIGKILL inside a save", "rank": args.save_kill_rank, "step": save_kill}] if save_kill else []),
        "returncode": run["returncode"],
        "restarts": run["restarts"],
        "resumed_at": [s for _, s in run["resumes"]],
        "expected_resumes": expected_resumes,
        "wall_s": round(run["wall_s"], 1),
        **continuity(run["losses"], n),
    }
    final = {s: v[-1] for s, v in sorted(run["losses"].items())}
    ok = (
        run["returncode"] == 0
        and run["restarts"] == n_faults
        and summary["resumed_at"] == expected_resumes
        and not summary["missing"]
        and not summary["replay_mismatches"]
    )
    if not args.no_reference:
        ref = run_torchrun(train_overrides(run_dir / "reference", n, k))
        ref_final = {s: v[-1] for s, v in sorted(ref["losses"].items())}
        summary["reference_returncode"] = ref["returncode"]
        summary["reference_wall_s"] = round(ref["wall_s"], 1)
        summary["loss_differs_from_reference_at"] = [s for s in final if ref_final.get(s) != final[s]][:20]
        differ = checkpoint_differences(final_checkpoint(run_dir / "soaked"), final_checkpoint(run_dir / "reference"))
        summary["final_checkpoint_differs_in"] = differ[:20]
        ok = ok and ref["returncode"] == 0 and not summary["loss_differs_from_reference_at"] and not differ
    summary["first_loss"], summary["last_loss"] = final.get(1), final.get(n)
    summary["survived"] = ok
    (run_dir / "soak.json").write_text(json.dumps(summary, indent=1) + "\n")
    with open(run_dir / "loss.csv", "w") as fh:
        fh.write("step,loss\n" + "".join(f"{s},{v}\n" for s, v in final.items()))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot(list(final), list(final.values()), lw=0.8)
        for kill in summary["kills"]:
            ax.axvline(kill.get("after_step", kill.get("step")), color="r", ls="--", lw=0.8)
        ax.set(xlabel="step", ylabel="loss", yscale="log", title="soak: loss across 2 injected kills (red)")
        fig.tight_layout()
        fig.savefig(run_dir / "loss.png", dpi=110)
    except ImportError:
        pass
    print(json.dumps(summary, indent=1))
    if not ok:
        print(run["tail"], file=sys.stderr)
    print(f"soak {'PASSED' if ok else 'FAILED'}: results in {run_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
