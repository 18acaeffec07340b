"""Checkpoints with torch.distributed.checkpoint (DCP), made visible atomically.

A checkpoint is a directory `step_00000100/` written by every rank in parallel. It is first
written as `step_00000100.tmp/` and renamed only after every rank has finished, so a directory
without the suffix is always complete: a crash mid-save leaves a `.tmp` that is ignored (and
cleaned at the next start). Only the last `keep` complete checkpoints are kept.

Contents: model and optimizer (DCP's FQN-keyed state dicts, so DDP, compile and activation
checkpointing wrappers do not change the keys), the training state (step, scheduler, data
position) and each rank's RNG states under a per-rank key.
"""

from __future__ import annotations

import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from train.config import ConfigError

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _STEP_DIR.match(p.name) and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: p.name)


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


class Checkpointer:
    """Saves and restores `model`, `optimizer` and an arbitrary picklable `train_state` dict."""

    def __init__(self, directory: str | Path, keep: int, rank: int, device: torch.device):
        self.dir, self.keep, self.rank, self.device = Path(directory), keep, rank, device

    def _state(self, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict) -> dict:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # DCP loads exactly the keys of the dict it is given, and the training state's keys are not
        # known before loading: so it travels as one opaque blob (identical on every rank).
        # RNG streams differ per rank, hence a per-rank key (DCP de-duplicates equal keys).
        return {
            "model": model_sd,
            "optim": optim_sd,
            "train": pickle.dumps(train_state),
            f"rng_rank{self.rank}": _rng_state(self.device),
        }

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict) -> Path:
        final = self.dir / f"step_{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            self.dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dcp.save(self._state(model, optimizer, train_state), checkpoint_id=tmp)
        dist.barrier()  # every rank's shards are on disk before the rename publishes them
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            for old in complete_checkpoints(self.dir)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint named by `checkpoint.resume`: '' none, 'latest' (None if there is none), or a path."""
        if not resume:
            return None
        if resume == "latest":
            found = complete_checkpoints(self.dir)
            return found[-1] if found else None
        path = Path(resume)
        if not (path / ".metadata").is_file():
            raise ConfigError(f"checkpoint.resume: {path} is not a complete checkpoint (no .metadata)")
        return path

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Restore model, optimizer and this rank's RNG in place; return the saved train_state."""
        state = self._state(model, optimizer, {})
        saved_keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        rng_key = f"rng_rank{self.rank}"
        if not any(k.startswith(rng_key + ".") for k in saved_keys):
            state.pop(rng_key)  # saved with fewer ranks: this rank keeps its fresh RNG
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rng_key in state:
            _set_rng_state(state[rng_key], self.device)
        return pickle.loads(state["train"])

    def clean_partial(self) -> None:
        """Remove `.tmp` directories left by a save that never finished (rank 0 only)."""
        if self.rank == 0 and self.dir.is_dir():
            for p in self.dir.glob("step_*.tmp"):
                shutil.rmtree(p, ignore_errors=True)
