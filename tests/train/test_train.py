"""The loop: cp = 2 equals cp = 1 on the same batch, the torchrun entry point learns, failures are clear."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ringflash.train.config import ConfigError
from ringflash.train.data import IGNORE, DataLoader, build_source
from tests.dist_utils import REPO, run_ranks, torchrun
from tests.tiny_config import TINY, assert_matches_reference, tiny_config


def launch_script():
    """launch/train.py as a module (launch/ is not a package), to call its main() in-process."""
    spec = importlib.util.spec_from_file_location("launch_train", REPO / "launch" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny(tmp_path: Path | None = None, *overrides: str):
    """A model and task small enough for a few CPU steps in well under a second."""
    return tiny_config(
        tmp_path, "--train.steps=4", "--train.warmup_steps=1", "--checkpoint.enabled=false", *overrides
    )


def _cp_vs_single(rank, world, cfg):
    """On every rank: one step's loss and gradients through the ring equal one process on whole sequences."""
    from ringflash.train.model import Transformer
    from ringflash.train.parallel import distributed, parallelize
    from ringflash.train.trainer import forward_backward

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
        # Head-parallel × ring (cp_ring, cp_heads) = (2, 2) (H = 2, Hkv = 1 < 2: K/V replicated), and
        # all of cp as heads (r = 1) beside dp = 2.
        (4, ["--parallel.cp=4", "--parallel.cp_heads=2", "--data.passkey_loss=answer"]),
        (4, ["--parallel.cp=2", "--parallel.cp_heads=2", "--data.passkey_loss=all", "--parallel.layout=contiguous"]),
    ],
    ids=["zigzag-answer-accum", "contiguous-all", "dp2", "dp2-cp4", "checkpointed", "ring2-heads2", "dp2-heads2"],
)
def test_parallel_step_matches_one_process(world, overrides):
    cfg = tiny(None, *overrides)
    losses = run_ranks(_cp_vs_single, world, args=(cfg,))
    assert len(set(losses)) == 1, losses


def test_lr_schedule():
    from ringflash.train.trainer import lr_lambda

    # Linear warm-up to the peak over 4 steps, then cosine from 1 down to min_lr_ratio at `steps`.
    f = lr_lambda(tiny(None, "--train.steps=10", "--train.warmup_steps=4", "--train.min_lr_ratio=0.1"))
    assert [f(s) for s in (0, 1, 3, 4)] == [0.25, 0.5, 1.0, 1.0]
    assert f(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 6)))
    assert f(10) == pytest.approx(0.1)
    assert lr_lambda(tiny(None, "--train.warmup_steps=0"))(0) == 1.0  # no warm-up: the first step at the peak


def _steps_vs_plain_pytorch(rank, world, cfg, multipliers):
    """The loop's parameter updates equal a plain PyTorch loop: global-mean loss, clipped gradient,
    AdamW with decay on matrices only, and the lr of each step."""
    from ringflash.train.model import Transformer
    from ringflash.train.trainer import train

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
    from ringflash.train.trainer import train

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
    from ringflash.train.checkpoint import complete_checkpoints

    saved = complete_checkpoints(tmp_path / "checkpoints")
    assert saved and not list((tmp_path / "checkpoints").glob("*.tmp"))


def _gradient_norm_overflows_at_step_2(rank, world, cfg):
    from ringflash.train.trainer import train

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
    from ringflash.train.checkpoint import complete_checkpoints

    # Stopped before that step's update and save: the last checkpoint is the last good step.
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step_00000001"]


def test_bad_data_path_fails_before_training(tmp_path):
    cfg = tiny(tmp_path, "--data.kind=text", f"--data.path={tmp_path / 'nope.txt'}")
    with pytest.raises(Exception, match=r"data.path: .*nope.txt does not exist"):
        run_ranks(_train_in_ranks, 1, args=(cfg,))


@pytest.mark.slow
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
    # 32 sequences of 128 tokens per step, sharded into halves of 64 tokens.
    assert "dp 1 × cp 2 on cpu (gloo) | 4096 tokens/step, 64 per rank per seq" in out.stdout
    assert out.stdout.count("dp 1 × cp 2") == 1  # only rank 0 prints
    done = next(line for line in out.stdout.splitlines() if line.startswith("done:"))
    first, last = (float(v) for v in done.split("loss ")[1].split(" -> "))
    assert last < first - 1.0, done
    [run] = [tb.parent for tb in (tmp_path / "run").glob("*/tb")]  # <logging.dir>/<run id>/
    assert list((run / "tb").glob("*/events.out.tfevents.*"))
    # The closing lines: what ran, accuracy by depth and by the rank holding the key, where the logs are.
    assert "summary: trained 20 steps in " in out.stdout and "on 2 cpu processes (cp = 2, dp = 1)" in out.stdout
    assert "the query, at the end, is on rank 0:" in out.stdout
    assert "  bucket 1: key at tokens    33-62    held by rank 1 (another rank): " in out.stdout
    assert "  by the rank holding the key: rank 0 " in out.stdout
    assert f"(every run: tensorboard --logdir {tmp_path / 'run'})" in out.stdout
    assert f"checkpoint of step 20: {run / 'checkpoints' / 'step_00000020'}" in out.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((run / "tb").iterdir())))
    events.Reload()
    assert {"recall/acc_bucket3", "recall/acc_min", "recall/acc_key_on_rank1"} <= set(events.Tags()["scalars"])


def _cp_heads_chosen(rank, world, cfg):
    from ringflash.train.parallel import distributed

    os.environ["LOCAL_WORLD_SIZE"] = str(world - rank)  # rank 1 sees itself alone on its node
    with distributed(cfg.parallel, "cpu", run=cfg) as pc:
        return pc.dims.cp_heads, pc.head_group is not None


def test_cp_heads_auto_is_rank_0s_choice_on_every_rank():
    # At 16k tokens with 2 K/V heads the planner takes head parallelism inside one node of 2 and the
    # ring across two nodes of 1: ranks choosing from their own views would build different meshes.
    shape = ["--model.dim=512", "--model.n_heads=8", "--model.n_kv_heads=2", "--data.seq_len=16384"]
    cfg = tiny(None, "--parallel.cp=2", "--parallel.cp_heads=auto", *shape)
    assert run_ranks(_cp_heads_chosen, 2, args=(cfg,)) == [(2, True), (2, True)]


@pytest.mark.slow
def test_torchrun_cp_heads_auto(tmp_path):
    out = torchrun(
        REPO / "launch" / "train.py",
        *TINY,
        "--parallel.cp=2",
        "--parallel.cp_heads=auto",
        "--train.steps=2",
        "--train.warmup_steps=1",
        f"--logging.dir={tmp_path}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    chosen = "parallel.cp_heads = auto: 2 (ringflash.plan for 2 GPUs, as H100/H200s (this run: cpu): head-parallel u=2 "
    assert out.stdout.count(chosen) == 1, out.stdout  # rank 0 alone says it
    assert "done: step 2, loss " in out.stdout
    # The checkpoint keeps what was asked and what ran.
    state = json.loads((tmp_path / "checkpoints" / "step_00000002" / "train_state.json").read_text())
    assert state["config"]["parallel"]["cp_heads"] == "auto"
    assert (state["parallel_dims"]["cp_heads"], state["parallel_dims"]["cp_scheme"]) == (2, "ring")


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0), ("Tesla T4", 0.0)],
)
def test_peak_tflops_by_gpu_name(monkeypatch, name, peak):
    from ringflash.train.metrics import peak_tflops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops(torch.device("cuda", 0), 0.0) == peak  # the most specific name fragment wins
    assert peak_tflops(torch.device("cuda", 0), 400.0) == 400.0  # a configured peak beats the guess


def test_config_error_has_no_traceback():
    with pytest.raises(ConfigError):
        tiny(None, "--parallel.cp=2", "--data.seq_len=250")


@pytest.mark.parametrize(
    ("arg", "message"),
    [("--train.lr=-1", "train.lr: must be > 0, got -1.0"), ("--train.lr=nan", "train.lr: must be finite and > 0")],
)
def test_cli_bad_lr_is_one_line_not_a_traceback(capsys, arg, message):
    # Before the range check, torch's AdamW raised it from inside the run: exit 1 and a traceback.
    assert launch_script().main([arg]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1, err


def test_gpu_config_without_a_gpu_stops_before_anything(tmp_path, monkeypatch, capsys):
    # device = "cuda" in configs/gpu*.toml: no silent ~100M-parameter run on the CPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # Were it to start, it would fill the CPU's memory: fail at once instead.
    monkeypatch.setattr("train.trainer._loop", lambda *args: pytest.fail("gpu1.toml started training on the CPU"))
    argv = ["--config", str(REPO / "configs" / "gpu1.toml"), f"--logging.dir={tmp_path / 'run'}"]
    assert launch_script().main(argv) == 2
    assert capsys.readouterr().err == "error: train.device: cuda requested but no CUDA device is available\n"
    assert not (tmp_path / "run").exists()


def _rejected_runs(rank, world, tmp: Path):
    from ringflash.train.trainer import train

    tb = "--logging.tensorboard=true"
    with pytest.raises(ConfigError, match=r"data.path: .*does not exist"):  # the first check
        train(tiny(tmp, tb, "--data.kind=text", f"--data.path={tmp / 'nope.txt'}"))
    train(tiny(tmp, "--checkpoint.enabled=true"))  # TensorBoard off
    with pytest.raises(ConfigError, match=r"already holds checkpoints"):  # the last check
        train(tiny(tmp, tb, "--checkpoint.enabled=true"))
    return sorted(p.name for p in tmp.iterdir())


def test_rejected_run_leaves_no_tensorboard_dir(tmp_path):
    assert run_ranks(_rejected_runs, 1, args=(tmp_path,)) == [["checkpoints"]]


def _launch_twice(rank, world, first: list[str], again: list[str]) -> list[tuple[int, str]]:
    """launch/train.py's main() on `first`, then on `again`: exit code and stdout of each."""
    cli, runs = launch_script(), []
    for argv in (first, again):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli.main(argv)
        runs.append((code, out.getvalue()))
    return runs


@pytest.mark.parametrize(
    ("stop", "at"),
    [((), "train.steps = 2"), (("--train.steps=4", "--train.stop_at=2"), "train.stop_at = 2")],
    ids=["steps", "stop_at"],
)
def test_resume_at_the_end_says_nothing_to_do(tmp_path, stop, at):
    argv = [*TINY, f"--logging.dir={tmp_path}", "--logging.tensorboard=true", "--train.steps=2", *stop]
    argv.append("--data.eval_samples=2")  # TINY evaluates nothing; this test reads the accuracy line
    [[(code, out), (again_code, again)]] = run_ranks(_launch_twice, 1, args=(argv, [*argv, "--resume"]))
    assert code == again_code == 0
    assert "passkey accuracy" in out and "done: step 2, loss" in out, out
    # Nothing evaluated, saved or logged again: one line for the resume, one for the end.
    resumed, done = again.splitlines()
    assert resumed.startswith("resumed from ") and resumed.endswith("step_00000002 at step 2"), again
    assert done == f"done: step 2, the run is already at {at}: nothing to do"
    assert len(list(tmp_path.glob("tb/*/events.out.tfevents.*"))) == 1  # the first run's only
