"""The tiny CPU configuration the training tests share (a few steps in well under a second), and
their check that a parallel run equals its single-process reference."""

from __future__ import annotations

from pathlib import Path

import torch

from ringflash.train.config import Config, load_config

TINY = [
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.n_heads=2",
    "--model.n_kv_heads=1",
    "--data.seq_len=256",
    "--data.batch_size=2",
    # No evaluation by default: at cp = 2 the depth buckets must be a multiple of 2·cp, and four
    # buckets of 64 tokens cannot hold a passkey; the tests that evaluate ask for it.
    "--data.eval_buckets=2",
    "--data.eval_samples=0",
    "--logging.progress_bar=false",
    "--logging.tensorboard=false",
    "--logging.run_id=",  # logging.dir is the run directory: the tests name their paths
    "--train.device=cpu",
]


def tiny_config(run_dir: Path | None, *overrides: str) -> Config:
    """TINY, logging into `run_dir` if given, then `overrides` (later ones win)."""
    base = TINY + ([f"--logging.dir={run_dir}"] if run_dir is not None else [])
    return load_config(None, base + list(overrides))


def assert_matches_reference(loss, ref_loss, model, reference) -> None:
    """The parallel run's loss and every parameter's gradient equal the cp = 1 reference's."""
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")

