"""A checkpoint's files: the manifest of checksums, and reading what DCP wrote without running code.

`manifest.json` holds the sha256 and size of every other file of a checkpoint; `verify` checks
them (every rank hashes a share) and names the first damaged or missing file, and refuses a
checkpoint without one unless the caller's flag says to trust it. `.metadata` is
DCP's pickle: `SafeReader` reads it with an unpickler that admits only DCP's metadata classes,
`torch.Size` and dtypes. `SafePlanner` lets DCP unpickle its non-tensor values only once a
`weights_only` load has accepted them (tensors already load that way). `train_state.json` is
plain JSON; the pickled training state of older checkpoints is read admitting no classes at all.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ringflash.train.config import ConfigError

MANIFEST, TRAIN_STATE = "manifest.json", "train_state.json"


class CheckpointError(ConfigError):
    """A checkpoint cannot be resumed by this run: another model shape, unreadable or corrupt."""


def write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def agree(error: str | None, kind: type[Exception] = CheckpointError) -> None:
    """Raise `kind` on every rank if any rank has an `error`: the first in rank order, prefixed with
    the ranks that had it unless every rank had that very one (the same files, read alike)."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is None:
        return
    had = [r for r, e in enumerate(errors) if e == first]
    raise agreed(kind(first if len(had) == len(errors) else f"on rank {', '.join(map(str, had))}: {first}"))


def agreed(error: Exception) -> Exception:
    """`error`, marked as raised alike by every rank (after they compared notes): launch/train.py
    prints such an error once, from rank 0."""
    error.agreed = True
    return error


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ----------------------------------------------------------------------------- checksums


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()  # hashlib.file_digest needs Python 3.11
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def hash_share(directory: Path, names: list[str]) -> dict[str, str]:
    """sha256 of this rank's share of `names` (every rank hashes 1/world of the files), all ranks'
    results gathered: hashing a checkpoint of many GB on one rank alone would outlast the timeout."""
    rank, world = _rank_world()
    mine = {n: _sha256(directory / n) for n in names[rank::world]}
    if world == 1:
        return mine
    every: list[dict[str, str] | None] = [None] * world
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def write_manifest(directory: Path, digests: dict[str, str]) -> None:
    files = {n: {"sha256": h, "bytes": (directory / n).stat().st_size} for n, h in sorted(digests.items())}
    write_durably(directory / MANIFEST, json.dumps({"algorithm": "sha256", "files": files}, indent=1))


def verify(path: Path, trust_unverified: bool = False, flag: str = "--checkpoint.trust_unverified=true") -> str | None:
    """CheckpointError naming the first damaged or missing file of `path`, on every rank. A `path`
    without a manifest (written before manifests existed, or not by ringflash) has nothing to
    verify its files by: CheckpointError naming it and `flag`, the caller's way to set
    `trust_unverified`; with it, a warning is returned instead. Else None. Collective when distributed."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        listed = {name: entry["sha256"] for name, entry in files.items()}
        if any(Path(name).name != name or name in ("", ".", "..") for name in listed):
            raise ValueError("a listed name is not a file of the checkpoint directory")
    except FileNotFoundError:
        unverified = f"checkpoint {path} has no {MANIFEST}, so nothing verifies its files"
        if trust_unverified:
            return f"{unverified}: loaded without checksums, as {flag} asks"
        agree(
            f"{unverified} (written before manifests existed, or not by ringflash): refused. If you trust where "
            f"it came from, pass {flag} to load it without checksums"
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        agree(f"checkpoint {path}: {MANIFEST} is damaged ({type(e).__name__}: {e}); the checkpoint cannot be trusted")
    names = sorted(listed)
    missing = [n for n in names if not (path / n).is_file()]
    problem = None
    if missing:
        problem = f"checkpoint {path} is incomplete: {missing[0]} (listed in {MANIFEST}) is missing"
    agree(problem)
    digests = hash_share(path, names)
    damaged = [n for n in names if digests[n] != listed[n]]
    if damaged:
        agree(
            f"checkpoint {path} is damaged: {damaged[0]} does not match its sha256 in {MANIFEST}"
            + (f" (nor do {len(damaged) - 1} more files)" if len(damaged) > 1 else "")
        )
    return None


# ----------------------------------------------------------------------------- loading without running code


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` pickle, admitting only the classes DCP puts there (no functions that act)."""

    _ALLOWED = frozenset(
        {
            ("torch", "Size"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("torch.serialization", "_get_layout"),  # a lookup of torch.strided & co. by name
            ("pathlib", "PosixPath"),
            ("pathlib", "WindowsPath"),
            ("collections", "OrderedDict"),
        }
    )

    def find_class(self, module: str, name: str):
        own = module == dcp_metadata.__name__ and getattr(getattr(dcp_metadata, name, None), "__module__", "") == module
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if own or dtype or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata: refused")


class _PlainDataUnpickler(pickle.Unpickler):
    """Dicts, lists, strings and numbers only: the pickled training state of older checkpoints."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data: refused")


class SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by `_MetadataUnpickler` instead of `pickle.load`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner; its non-tensor values (optimizer hyperparameters) pass `weights_only`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # DefaultLoadPlanner unpickles these with weights_only=False; refuse anything a
        # weights_only load refuses first, so what reaches it is plain data and tensors.
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            what = found.group(1) if found else "objects beyond plain data and tensors"
            raise pickle.UnpicklingError(
                f"{read_item.dest_index.fqn!r} holds {what}: refused, since loading it could run code"
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)


def read_tensors(path: Path, state: dict) -> None:
    """`dcp.load(state)` from `path`, nothing unpickled but plain data; CheckpointError otherwise."""
    try:
        dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner())
    except (OSError, EOFError, pickle.UnpicklingError, CheckpointException) as e:  # CheckpointException is a
        raise CheckpointError(f"checkpoint {path} cannot be read: {first_line(e)}") from None  # BaseException


def read_metadata(path: Path) -> Metadata:
    try:
        return SafeReader(path).read_metadata()
    except (OSError, EOFError, ValueError, AttributeError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"checkpoint {path}: .metadata cannot be read: {first_line(e)}") from None


def read_train_state(path: Path, metadata: Metadata) -> dict:
    """The training state saved with `path`: `train_state.json`, or an older checkpoint's pickle."""
    if (path / TRAIN_STATE).is_file():
        try:
            state = json.loads((path / TRAIN_STATE).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path}: {TRAIN_STATE} cannot be read: {e}") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint {path}: {TRAIN_STATE} holds a {type(state).__name__}, not an object")
        return state
    if "train" not in metadata.state_dict_metadata:
        raise CheckpointError(f"checkpoint {path} has no {TRAIN_STATE}: not a ringflash training checkpoint")
    head = {"train": b""}
    read_tensors(path, head)
    try:
        return _PlainDataUnpickler(io.BytesIO(head["train"])).load()
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {path} is from an older ringflash and its pickled training state holds more than plain "
            f"data ({e}): not loaded, since unpickling it could run code"
        ) from None


def first_line(e: BaseException) -> str:
    """The informative line of an exception; DCP's wrap every rank's traceback in one message."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    return (errors or lines or [type(e).__name__])[-1]
