"""Every shipped config's early learning rate is within what trains at its width and depth, and
the 7B settings whose loss rose (lr 3e-5 after 2 warm-up steps) are warned about."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ringflash.train.config import early_update_warning, load_config
from ringflash.train.hf_model import build_model
from ringflash.train.trainer import fan_in_and_depth

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
