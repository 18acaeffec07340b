"""The loop: cp = 2 equals cp = 1 on the same batch, the torchrun entry point learns, failures are clear."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from tiny_config import assert_matches_reference, tiny_config

from train.config import ConfigError
from train.data import IGNORE, DataLoader, build_source

REPO = Path(__file__).resolve().parent.parent


def tiny(tmp_path: Path | None = None, *overrides: str):
    """A model and task small enough for a few CPU steps in well under a second."""
    return tiny_config(
        tmp_path, "--train.steps=4", "--train.warmup_steps=1", "--checkpoint.enabled=false", *overrides
    )


def _cp_vs_single(rank, world, cfg):
    """On every rank: one step's loss and gradients through the ring equal one process on whole sequences."""
    from train.model import Transformer
    from train.parallel import distributed, parallelize
    from train.trainer import forward_backward

    with distributed(cfg.parallel, "cpu") as pc:
        torch.manual_seed(0)
        model = Transformer(cfg.model)  # float32: the kernels' widest dtype
        reference = copy.deepcopy(model)  # keeps the plain local attention: the cp = 1 oracle
        ddp = parallelize(model, pc, cfg)
        source = build_source(cfg.data, cfg.model.vocab_size)
        loaders = [
            DataLoader(source, cfg.data.batch_size, cfg.train.grad_accum, r, pc.dims.dp) for r in range(pc.dims.dp)
        ]
        batches = [loader.next() for loader in loaders]  # every dp rank's micro-batches
        loss = forward_backward(ddp, batches[pc.dp_rank], pc, cfg.parallel.layout, contextlib.nullcontext())

        micros = [m for b in batches for m in b]
        n_tokens = sum(int((y != IGNORE).sum()) for _, y in micros)
        ref_loss = (
            sum(
                F.cross_entropy(reference(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
                for x, y in micros
            )
            / n_tokens
        )
        ref_loss.backward()
        assert_matches_reference(loss, ref_loss, model, reference)
        return float(loss)


@pytest.mark.parametrize(
    ("world", "overrides"),
    [
        # The answer's labels all sit on one cp rank: the global-mean normalisation is what makes this pass.
        (2, ["--parallel.cp=2", "--data.passkey_loss=answer", "--train.grad_accum=2"]),
        (2, ["--parallel.cp=2", "--data.passkey_loss=all", "--parallel.layout=contiguous"]),
        (2, ["--parallel.cp=1", "--data.passkey_loss=answer"]),  # dp = 2: the same global mean
        (8, ["--parallel.cp=4", "--data.passkey_loss=answer"]),  # dp 2 × cp 4, as on an 8-GPU node
        # Each block replayed in the backward, the ring and its communication with it.
        (2, ["--parallel.cp=2", "--data.passkey_loss=all", "--train.activation_checkpointing=true"]),
    ],
    ids=["zigzag-answer-accum", "contiguous-all", "dp2", "dp2-cp4", "checkpointed"],
)
def test_parallel_step_matches_one_process(world, overrides):
    cfg = tiny(None, *overrides)
    losses = run_ranks(_cp_vs_single, world, args=(cfg,))
    assert len(set(losses)) == 1, losses


def _train_in_ranks(rank, world, cfg):
    from train.trainer import train

    return train(cfg).losses


def test_non_finite_loss_stops_cleanly(tmp_path):
    # An absurd learning rate overflows within a few steps; the run must stop with a clear
    # message and leave only complete checkpoints behind.
    cfg = tiny(
        tmp_path,
        "--train.lr=1e12",
        "--train.steps=30",
        "--train.grad_clip=0",
        "--checkpoint.enabled=true",
        "--checkpoint.interval=1",
        "--train.warmup_steps=0",
    )
    with pytest.raises(Exception, match=r"non-finite (loss|gradient norm) at step .*stopping without updating"):
        run_ranks(_train_in_ranks, 1, args=(cfg,))
    from train.checkpoint import complete_checkpoints

    saved = complete_checkpoints(tmp_path / "checkpoints")
    assert saved and not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_bad_data_path_fails_before_training(tmp_path):
    cfg = tiny(tmp_path, "--data.kind=text", f"--data.path={tmp_path / 'nope.txt'}")
    with pytest.raises(Exception, match=r"data.path: .*nope.txt does not exist"):
        run_ranks(_train_in_ranks, 1, args=(cfg,))


def torchrun(tmp_path: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",
        str(REPO / "launch" / "train.py"),
        *args,
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_torchrun_two_ranks_loss_falls(tmp_path):
    out = torchrun(
        tmp_path,
        "--config",
        str(REPO / "configs" / "tiny_cpu.toml"),
        "--train.steps=20",
        "--train.eval_every=0",
        "--logging.progress_bar=false",
        f"--logging.dir={tmp_path / 'run'}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dp 1 × cp 2 on cpu (gloo)" in out.stdout
    assert out.stdout.count("dp 1 × cp 2") == 1  # only rank 0 prints
    done = next(line for line in out.stdout.splitlines() if line.startswith("done:"))
    first, last = (float(v) for v in done.split("loss ")[1].split(" -> "))
    assert last < first - 1.0, done
    assert list((tmp_path / "run" / "tb").glob("*/events.out.tfevents.*"))


def test_torchrun_rejects_cp_not_dividing_world(tmp_path):
    out = torchrun(
        tmp_path,
        "--config",
        str(REPO / "configs" / "tiny_cpu.toml"),
        "--parallel.cp=3",
        "--parallel.layout=contiguous",
        "--data.seq_len=768",
        "--logging.tensorboard=false",
    )
    assert out.returncode != 0
    assert "parallel.cp (3) must divide the world size (2)" in out.stderr


def test_config_error_has_no_traceback():
    with pytest.raises(ConfigError):
        tiny(None, "--parallel.cp=2", "--data.seq_len=250")
