"""launch/soak.py's checkpoint comparison reads checkpoints as tensors and plain data only
(`weights_only=True`), and names what differs."""

from __future__ import annotations

from pathlib import Path

import torch

from ringflash.train.checkpoint import Checkpointer
from tests.dist_utils import run_ranks
from tests.train.test_reliability import _load_script


def _compare(rank, world, tmp: Path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()

    def save(name: str) -> Path:
        return Checkpointer(tmp / name, keep=1, rank=rank, device=torch.device("cpu")).save(1, model, opt, {"step": 1})

    a, b = save("a"), save("b")
    with torch.no_grad():
        model.bias.add_(torch.randn(3, generator=torch.Generator().manual_seed(1)))  # the global RNG is saved too
    c = save("c")
    soak = _load_script("soak")
    return soak.checkpoint_differences(a, b), soak.checkpoint_differences(a, c)


def test_checkpoint_differences_name_the_entries_that_differ(tmp_path):
    [(same, changed)] = run_ranks(_compare, 1, args=(tmp_path,))
    assert same == []
    assert changed == ["model.bias"]
