"""Every shipped config's early learning rate is within what trains at its width and depth; the 7B
settings whose loss rose (lr 3e-5 after 2 warm-up steps) are warned about; the trainer warns at
every start, fresh or resumed, naming the runs the bound rests on, and `train.strict_lr` makes it
an error on every rank before any work."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch

from ringflash.train.config import ConfigError, check_early_update, early_update_warning, load_config
from ringflash.train.hf_model import build_model
from ringflash.train.trainer import fan_in_and_depth
from tests.dist_utils import REPO, RankFailure, run_ranks
from tests.tiny_config import tiny_config

CONFIGS = sorted(Path(__file__).parents[2].glob("configs/*.toml"))


def _shape(path):
    cfg = load_config(path)
    with torch.device("meta"):  # shapes only: no memory for a 7B
        return cfg, fan_in_and_depth(build_model(cfg), cfg)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_start_within_the_bound(path):
    if "hf" in path.stem:
        pytest.importorskip("transformers")
    cfg, shape = _shape(path)
    assert early_update_warning(cfg.train, *shape) is None


def test_the_diverging_7b_settings_are_warned():
    cfg, (fan_in, layers) = _shape(Path(__file__).parents[2] / "configs/gpu8_llama8b_fsdp_128k.toml")
    assert (fan_in, layers) == (14336, 32)
    bad = dataclasses.replace(cfg.train, lr=3e-5, warmup_steps=2)
    msg = early_update_warning(bad, fan_in, layers)
    assert msg is not None and "Lower train.lr or lengthen train.warmup_steps" in msg
    assert early_update_warning(dataclasses.replace(cfg.train, lr=1e-6, warmup_steps=2), fan_in, layers) is None


# The tiny model's largest fan-in is 128 (its SwiGLU) over 2 layers: 0.05 · 128 · 2 = 12.8 > 8.
HIGH_LR = ["--train.lr=0.05", "--train.warmup_steps=1", "--train.steps=2", "--checkpoint.enabled=true"]
WARNING = (
    "warning: train.lr = 0.05 with train.warmup_steps = 1 reaches lr 0.05 by step 10: with fan-ins up to 128 over "
    "2 layers each step moves the model by about 13 (lr·fan-in·layers), above the 8 the recorded runs allow (runs "
    'whose loss fell sat at 0.28-3.7, a ~7B whose loss rose 7 -> 40 at 14: benchmarks/training.jsonl, "The '
    "learning-rate bound's runs\"; a 2.8B rose at 1.4: benchmarks/acceptance.jsonl), and the loss may rise. "
    "Lower train.lr or lengthen train.warmup_steps (Llama 3's "
    "8B recipe: lr 3e-4 over 2000 warm-up steps); --train.strict_lr=true makes this an error"
)


def test_the_runs_the_bound_names_are_recorded():
    records = [json.loads(line) for line in (REPO / "benchmarks" / "training.jsonl").read_text().splitlines()]
    [rec] = [r for r in records if r["title"].startswith("The learning-rate bound's runs")]
    sizes = {row["config"]: row["lr·fan-in·layers"] for row in rec["results"]}
    fell = [v for c, v in sizes.items() if "rose" not in c and "lr 3e-5" not in c]
    assert (min(fell), max(fell)) == (0.282, 3.72) and max(fell) < rec["args"]["bound"] == 8.0
    assert sizes["gpu8_llama8b_fsdp_128k, lr 3e-5 after 2 warm-up steps"] == 13.8


def _train_printing(rank, world, cfg) -> str:
    from ringflash.train.trainer import train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(cfg)
    return out.getvalue()


def test_warned_at_a_fresh_start_and_on_resume(tmp_path):
    fresh = tiny_config(tmp_path, *HIGH_LR, "--train.stop_at=1")
    resumed = tiny_config(tmp_path, *HIGH_LR, "--checkpoint.resume=latest")
    [first], [second] = run_ranks(_train_printing, 1, args=(fresh,)), run_ranks(_train_printing, 1, args=(resumed,))
    assert "resumed from" not in first and "resumed from" in second, second
    for out in (first, second):
        assert [line for line in out.splitlines() if line.startswith("warning:")] == [WARNING], out


def test_strict_lr_refuses_on_every_rank_before_any_work(tmp_path):
    cfg = tiny_config(tmp_path / "run", *HIGH_LR, "--parallel.cp=2", "--train.strict_lr=true")
    with pytest.raises(RankFailure) as failure:
        run_ranks(_train_printing, 2, args=(cfg,))
    assert sorted(failure.value.errors) == [0, 1]
    refusal = "train.strict_lr = true refuses this run: " + WARNING.removeprefix("warning: ").split("; --train")[0]
    for tb in failure.value.errors.values():
        assert f"ConfigError: {refusal}\n" in tb, tb
    assert not (tmp_path / "run").exists()  # no run directory, checkpoint or log


def test_strict_lr_lets_a_run_within_the_bound_start():
    t = tiny_config(None, "--train.lr=0.01", "--train.warmup_steps=1", "--train.strict_lr=true").train
    assert check_early_update(t, 128, 2) is None  # 2.56: within the bound
    with pytest.raises(ConfigError, match=r"^train.strict_lr = true refuses this run: train.lr = 0.05 "):
        check_early_update(dataclasses.replace(t, lr=0.05), 128, 2)
