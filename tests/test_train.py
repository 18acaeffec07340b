"""The loop: cp = 2 equals cp = 1 on the same batch, the torchrun entry point learns, failures are clear."""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_utils import REPO, run_ranks, torchrun
from tiny_config import assert_matches_reference, tiny_config

from train.config import ConfigError
from train.data import IGNORE, DataLoader, build_source


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


def test_lr_schedule():
    from train.trainer import lr_lambda

    # Linear warm-up to the peak over 4 steps, then cosine from 1 down to min_lr_ratio at `steps`.
    f = lr_lambda(tiny(None, "--train.steps=10", "--train.warmup_steps=4", "--train.min_lr_ratio=0.1"))
    assert [f(s) for s in (0, 1, 3, 4)] == [0.25, 0.5, 1.0, 1.0]
    assert f(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 6)))
    assert f(10) == pytest.approx(0.1)
    assert lr_lambda(tiny(None, "--train.warmup_steps=0"))(0) == 1.0  # no warm-up: the first step at the peak


def _steps_vs_plain_pytorch(rank, world, cfg, multipliers):
    """The loop's parameter updates equal a plain PyTorch loop: global-mean loss, clipped gradient,
    AdamW with decay on matrices only, and the lr of each step."""
    from train.model import Transformer
    from train.trainer import train

    torch.manual_seed(cfg.train.seed)
    reference = Transformer(cfg.model)  # the loop's init: the same seed
    start = {name: p.detach().clone() for name, p in reference.named_parameters()}
    result = train(cfg)

    t = cfg.train
    params = list(reference.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},  # norm weights: no decay
    ]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))
    loader = DataLoader(build_source(cfg.data, cfg.model.vocab_size), cfg.data.batch_size, 1, 0, 1)
    for step, multiplier in enumerate(multipliers, 1):
        ((x, y),) = loader.next()
        loss = F.cross_entropy(reference(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = t.lr * multiplier
        optimizer.step()
        optimizer.zero_grad()
        torch.testing.assert_close(result.losses[step], loss.item(), rtol=1e-5, atol=0)
    for name, p in result.model.named_parameters():
        torch.testing.assert_close(
            p - start[name], reference.get_parameter(name) - start[name], rtol=1e-3, atol=1e-7, msg=name
        )


def test_steps_match_plain_pytorch():
    # A gradient norm clipped to 1e-7 leaves every element far below AdamW's eps (1e-8): the update
    # is then lr · g / eps, linear in the clipped gradient, so the loop's and the reference's
    # rounding differences stay relative, and an unclipped gradient (updates near ±lr) is far off.
    cfg = tiny(
        None,
        "--data.passkey_loss=all",
        "--data.eval_samples=0",
        "--train.steps=3",
        "--train.stop_at=2",
        "--train.warmup_steps=2",
        "--train.grad_clip=1e-7",
    )
    run_ranks(_steps_vs_plain_pytorch, 1, args=(cfg, [0.5, 1.0]))


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


def _gradient_norm_overflows_at_step_2(rank, world, cfg):
    from train.trainer import train

    clip, calls = torch.nn.utils.clip_grad_norm_, []

    def overflowing(params, max_norm):  # as if one gradient overflowed while the loss stayed finite
        calls.append(max_norm)
        norm = clip(params, max_norm)
        return norm if len(calls) < 2 else torch.tensor(float("inf"))

    torch.nn.utils.clip_grad_norm_ = overflowing  # in this forked rank only
    return train(cfg).losses


def test_non_finite_gradient_norm_stops_cleanly(tmp_path):
    cfg = tiny(tmp_path, "--checkpoint.enabled=true", "--checkpoint.interval=1", "--data.eval_samples=0")
    with pytest.raises(Exception, match=r"non-finite gradient norm at step 2 \(loss [0-9.]+, grad norm inf\)"):
        run_ranks(_gradient_norm_overflows_at_step_2, 1, args=(cfg,))
    from train.checkpoint import complete_checkpoints

    # Stopped before that step's update and save: the last checkpoint is the last good step.
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step_00000001"]


def test_bad_data_path_fails_before_training(tmp_path):
    cfg = tiny(tmp_path, "--data.kind=text", f"--data.path={tmp_path / 'nope.txt'}")
    with pytest.raises(Exception, match=r"data.path: .*nope.txt does not exist"):
        run_ranks(_train_in_ranks, 1, args=(cfg,))


def test_torchrun_two_ranks_loss_falls(tmp_path):
    out = torchrun(
        REPO / "launch" / "train.py",
        "--config",
        str(REPO / "configs" / "tiny_cpu.toml"),
        "--train.steps=20",
        "--train.eval_every=0",
        "--logging.progress_bar=false",
        f"--logging.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # 8 sequences of 512 tokens per step, sharded into halves of 256 tokens.
    assert "dp 1 × cp 2 on cpu (gloo) | 4096 tokens/step, 256 per rank per seq" in out.stdout
    assert out.stdout.count("dp 1 × cp 2") == 1  # only rank 0 prints
    done = next(line for line in out.stdout.splitlines() if line.startswith("done:"))
    first, last = (float(v) for v in done.split("loss ")[1].split(" -> "))
    assert last < first - 1.0, done
    assert list((tmp_path / "run" / "tb").glob("*/events.out.tfevents.*"))


def test_torchrun_rejects_cp_not_dividing_world(tmp_path):
    out = torchrun(
        REPO / "launch" / "train.py",
        "--config",
        str(REPO / "configs" / "tiny_cpu.toml"),
        "--parallel.cp=3",
        "--parallel.layout=contiguous",
        "--data.seq_len=768",
        "--logging.tensorboard=false",
        cwd=tmp_path,
    )
    assert out.returncode != 0
    assert "parallel.cp (3) must divide the world size (2)" in out.stderr


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0), ("Tesla T4", 0.0)],
)
def test_peak_tflops_by_gpu_name(monkeypatch, name, peak):
    from train.metrics import peak_tflops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops(torch.device("cuda", 0), 0.0) == peak  # the most specific name fragment wins
    assert peak_tflops(torch.device("cuda", 0), 400.0) == 400.0  # a configured peak beats the guess


def test_config_error_has_no_traceback():
    with pytest.raises(ConfigError):
        tiny(None, "--parallel.cp=2", "--data.seq_len=250")
