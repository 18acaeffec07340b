"""Checkpoints with torch.distributed.checkpoint (DCP), made visible atomically, checksummed,
and loaded without running code stored in them.

A checkpoint is a directory `step_00000100/` written by every rank in parallel. It is first
written as `step_00000100.tmp/` and renamed only after every rank has finished and the checksums
are written, so a directory without the suffix is always complete and has its manifest: a crash
mid-save leaves a `.tmp` that is ignored (and cleaned at the next start). Only the last `keep`
complete checkpoints are kept; an old one is first renamed to `.old` and only then deleted, so a
crash while deleting it never leaves a half-deleted directory under a complete checkpoint's name.
DCP fsyncs every file it writes and the directory is fsynced after the rename, so a published
checkpoint also survives a power cut. A failed write (a full disk) raises `CheckpointError` on
every rank and publishes nothing.

Files: DCP's shards (`*.distcp`) and `.metadata`; `train_state.json` (step, scheduler, data
position, config: plain data, never a pickle); `manifest.json`, the sha256 of every other file.
Contents of the shards: model and optimizer (DCP's FQN-keyed state dicts, so DDP, FSDP2, compile
and activation checkpointing wrappers do not change the keys; FSDP2's DTensors are saved as their
shards) and each rank's RNG states (tensors) under a per-rank key.

Loading first verifies the manifest (a damaged or missing file is named), then checks the
checkpoint against this run before touching the model: every rank must have resolved the same
checkpoint, and its parameter names and shapes must be this model's (a checkpoint of another model
shape names the differing `model.*` settings). Nothing in a checkpoint can run code when loaded
(train/checkpoint_files.py). A checkpoint without a manifest (written before manifests existed,
or not by ringflash) is refused, unless `checkpoint.trust_unverified` says to load it without
checksums (with a warning). What cannot be used raises `CheckpointError` (a `ConfigError`: the
launcher prints it as one line).

Another world size is not refused: DCP stores every tensor with its global shape and each rank
reads the pieces its own shards need, so a checkpoint of 4 ranks resumes on 2 and the reverse,
DDP's replicated tensors into FSDP2's shards and the reverse. The data continue from the global
sample index (train/data.py, `DataLoader`); with the same global batch the continuing run draws
the same samples every step as an uninterrupted one, and matches it to float32 rounding (the
order of the sums over ranks differs). At the same world size a resume is bit-exact.

Fault injection for tests and `launch/soak.py`: `RINGFLASH_FAULT=save:STEP:RANK[:ATTEMPT]` kills
rank RANK with SIGKILL while it saves step STEP, after its shards are written and before the
checkpoint is published, in torchrun attempt ATTEMPT (default 0; `TORCHELASTIC_RESTART_COUNT`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ringflash.train.checkpoint_files import (  # CheckpointError is re-exported: callers import it from here
    TRAIN_STATE,
    CheckpointError,
    agree,
    agreed,
    first_line,
    hash_share,
    read_metadata,
    read_tensors,
    read_train_state,
    verify,
    write_durably,
    write_manifest,
)

__all__ = ["CheckpointError", "Checkpointer", "complete_checkpoints"]

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _failpoint(where: str, step: int, rank: int) -> None:
    """Die here, like a killed process (no cleanup, no exception), if RINGFLASH_FAULT says so."""
    spec = os.environ.get("RINGFLASH_FAULT", "")
    if not spec:
        return
    parts = [*spec.split(":"), "0"]  # ATTEMPT defaults to 0
    try:
        at = (parts[0], int(parts[1]), int(parts[2]), int(parts[3]))
    except (IndexError, ValueError):
        raise ValueError(f"RINGFLASH_FAULT must be WHERE:STEP:RANK[:ATTEMPT], got {spec!r}") from None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if at == (where, step, rank, attempt):
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Delete a checkpoint directory: renamed away first (atomic), so it is never half-complete."""
    trash = path.with_name(path.name + ".old")
    shutil.rmtree(trash, ignore_errors=True)
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _STEP_DIR.match(p.name) and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: p.name)


# ----------------------------------------------------------------------------- save and load


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
    """Saves and restores `model`, `optimizer` and a JSON-serialisable `train_state` dict.

    `writer`: DCP's storage writer class for a directory (a test passes one that fails);
    `trust_unverified`: load a checkpoint without a manifest (`checkpoint.trust_unverified`).
    """

    def __init__(self, directory: str | Path, keep: int, rank: int, device: torch.device, writer=FileSystemWriter,
                 trust_unverified: bool = False):  # fmt: skip
        self.dir, self.keep, self.rank, self.device, self.writer = Path(directory), keep, rank, device, writer
        self.trust_unverified = trust_unverified

    def _state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # RNG streams differ per rank, hence a per-rank key (DCP de-duplicates equal keys).
        return {"model": model_sd, "optim": optim_sd, f"rng_rank{self.rank}": _rng_state(self.device)}

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict) -> Path:
        final = self.dir / f"step_{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        failed = f"saving checkpoint {final} failed"
        try:  # on every rank (the state is the same on all): all raise, none waits for the others
            text = json.dumps(train_state)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{failed}: the training state is not plain JSON data: {e}") from None
        error = None
        if self.rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                write_durably(tmp / TRAIN_STATE, text)
            except OSError as e:
                error = f"{failed}: {e}"
        agree(error)
        try:
            dcp.save(self._state(model, optimizer), storage_writer=self.writer(tmp))
        except (OSError, CheckpointException) as e:  # every rank gets a CheckpointException
            raise CheckpointError(f"{failed}: {first_line(e)} (nothing was published)") from None
        _failpoint("save", step, self.rank)
        dist.barrier()  # every rank's shards are on disk before they are hashed and published
        error = None
        try:
            digests = hash_share(tmp, sorted(p.name for p in tmp.iterdir() if p.is_file()))
            if self.rank == 0:
                write_manifest(tmp, digests)
                if final.exists():  # the same step saved again (a resumed run that stopped early)
                    _remove(final)
                tmp.rename(final)
                _fsync_dir(self.dir)
                for old in complete_checkpoints(self.dir)[: -self.keep]:
                    _remove(old)
        except OSError as e:
            error = f"{failed}: {e}"
        agree(error)
        return final

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint named by `checkpoint.resume`: '' none; 'latest' the latest complete one in
        the directory (CheckpointError if there is none); 'auto' the same, None if there is none
        (a torchrun restart before the first save); or a checkpoint path. The same on every rank."""
        if not resume:
            return None
        path, error = None, None
        if resume in ("latest", "auto"):
            found = complete_checkpoints(self.dir)
            path = found[-1] if found else None
            if path is None and resume == "latest":
                error = (
                    f"checkpoint.resume = latest: no complete checkpoint in {self.dir} to resume; "
                    "start without --resume for a new run"
                )
        else:
            path = Path(resume)
            if not (path / ".metadata").is_file():
                error = f"checkpoint.resume: {path} is not a complete checkpoint (no .metadata)"
        agree(error)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank loads collectively, so all must load the same one; they may not when
            # the checkpoint directory is not on a filesystem shared by every node.
            every: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(every, None if path is None else str(path))
            if len(set(every)) > 1:
                raise agreed(CheckpointError(
                    f"checkpoint.resume = {resume!r} resolves differently on different ranks: "
                    + ", ".join(f"{p} on rank {r}" for r, p in enumerate(every))
                    + f". checkpoint.dir ({self.dir}) must be on a filesystem every rank shares."
                ))  # fmt: skip
        return path

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, str | None]:
        """Restore model, optimizer and this rank's RNG in place; return the saved train_state and a
        warning (None, or: no manifest to verify, loaded as `trust_unverified` allows).

        Raises CheckpointError if there is no manifest (unless `trust_unverified`), a file is
        damaged (checked against the manifest first), the checkpoint holds another model
        (parameter names or shapes differ: checked before anything is loaded) or cannot be read;
        every rank raises, so the run stops.
        """
        warning = verify(path, self.trust_unverified)
        metadata = read_metadata(path)
        train_state = read_train_state(path, metadata)
        saved_keys = metadata.state_dict_metadata
        state = self._state(model, optimizer)
        _check_same_model(path, state["model"], saved_keys, model, train_state.get("config", {}).get("model"))
        rng_key = f"rng_rank{self.rank}"
        if not any(k.startswith(rng_key + ".") for k in saved_keys):
            state.pop(rng_key)  # saved with fewer ranks: this rank keeps its fresh RNG
        read_tensors(path, state)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rng_key in state:
            _set_rng_state(state[rng_key], self.device)
        return train_state, warning

    def clean_partial(self) -> None:
        """Remove what a killed save left: `.tmp` (never published) and `.old` (being deleted); rank 0."""
        if self.rank == 0 and self.dir.is_dir():
            for p in [*self.dir.glob("step_*.tmp"), *self.dir.glob("step_*.old")]:
                shutil.rmtree(p, ignore_errors=True)


def _check_same_model(path: Path, model_sd: dict, saved_keys: dict, model: nn.Module, saved_cfg: dict | None) -> None:
    """CheckpointError naming the parameters (and `model.*` settings) in which the checkpoint differs."""
    saved = {
        k.removeprefix("model."): tuple(m.size)
        for k, m in saved_keys.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    here = {k: tuple(v.shape) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    problems = [f"{k} is {saved[k]} there, {here[k]} here" for k in here if k in saved and saved[k] != here[k]]
    missing, extra = sorted(set(here) - set(saved)), sorted(set(saved) - set(here))
    if missing:
        problems.append(f"{len(missing)} parameter(s) of this model are not in it ({', '.join(missing[:3])}, ...)")
    if extra:
        problems.append(f"it has {len(extra)} parameter(s) this model lacks ({', '.join(extra[:3])}, ...)")
    if not problems:
        return
    settings = ""
    mine = getattr(getattr(model, "module", model), "cfg", None)
    if saved_cfg and dataclasses.is_dataclass(mine):
        mine = dataclasses.asdict(mine)
        differ = [f"model.{k} = {v!r} there, {mine[k]!r} here" for k, v in saved_cfg.items() if mine.get(k, v) != v]
        if differ:
            settings = " Its settings differ: " + "; ".join(differ) + "."
    raise CheckpointError(
        f"checkpoint {path} holds another model: {'; '.join(problems[:4])}.{settings}"
        " Resume with the same [model] settings, or start a new run in another checkpoint.dir."
    )
