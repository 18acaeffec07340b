"""A checkpoint cannot run code: crafted pickles in the three places a DCP checkpoint holds one
(ringflash's old training-state blob, a DCP value, DCP's `.metadata`) are refused on `--resume`
and by `launch/export_hf.py`, and the file their unpickling would create never appears. Having no
manifest, they are refused before any reading unless the flag that trusts such checkpoints is set;
with it, the readers' own refusal is what stops them."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ringflash.train.checkpoint import Checkpointer, CheckpointError
from tests.dist_utils import run_ranks
from tests.tiny_config import tiny_config
from tests.train.test_reliability import _load_script


class _CreatesFile:
    """Unpickling this creates the file `path` (the stand-in for any code a pickle can run)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _craft(where: str, directory: Path, marker: Path) -> Path:
    """A checkpoint whose `where` holds a pickle that would create `marker`."""
    directory.mkdir(parents=True)
    if where == "metadata":
        (directory / ".metadata").write_bytes(pickle.dumps(_CreatesFile(marker)))
    else:
        # "train_blob": the format ringflash wrote before train_state.json (a pickled dict in a DCP
        # value); "dcp_value": DCP's own pickle of a non-tensor value.
        blob = pickle.dumps({"step": 1, "config": _CreatesFile(marker)}) if where == "train_blob" else None
        dcp.save({"train": blob if blob is not None else _CreatesFile(marker)}, checkpoint_id=directory, no_dist=True)
    assert not marker.exists()
    return directory


WHERE = ["train_blob", "dcp_value", "metadata"]


def _resume(rank, world, run_dir: Path, checkpoint: Path, *flags: str):
    from ringflash.train.trainer import train

    with pytest.raises(CheckpointError, match=rf"checkpoint {checkpoint}") as err:
        train(tiny_config(run_dir, "--train.steps=2", f"--checkpoint.resume={checkpoint}", *flags))
    return str(err.value)


def _unverified(checkpoint: Path, flag: str) -> str:
    return (
        f"checkpoint {checkpoint} has no manifest.json, so nothing verifies its files (written before manifests "
        f"existed, or not by ringflash): refused. If you trust where it came from, pass {flag} to load it without "
        "checksums"
    )


@pytest.mark.parametrize("where", WHERE)
def test_resume_of_a_crafted_checkpoint_runs_no_code(tmp_path, where):
    marker = tmp_path / "created_by_unpickling"
    checkpoint = _craft(where, tmp_path / "crafted" / "step_00000001", marker)
    trusted = "--checkpoint.trust_unverified=true"
    [refused, msg] = [run_ranks(_resume, 1, args=(tmp_path / "run", checkpoint, *flags), timeout_s=60)[0]
                      for flags in ((), (trusted,))]  # fmt: skip
    assert refused == _unverified(checkpoint, trusted)
    assert not marker.exists()
    assert "refused" in msg or "not plain data" in msg or "Weights only load failed" in msg, msg


@pytest.mark.parametrize("where", WHERE)
def test_export_of_a_crafted_checkpoint_runs_no_code(tmp_path, where, capsys):
    marker = tmp_path / "created_by_unpickling"
    checkpoint = _craft(where, tmp_path / "crafted" / "step_00000001", marker)
    export = _load_script("export_hf")
    args = ["--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")]
    assert export.main(args) == 2
    assert capsys.readouterr().err == f"error: {_unverified(checkpoint, '--trust-unverified')}\n"
    assert export.main([*args, "--trust-unverified"]) == 2
    assert not marker.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: checkpoint {checkpoint}"), err
    assert err[:-1] == [  # older format
        f"warning: checkpoint {checkpoint} has no manifest.json, so nothing verifies its files: loaded without "
        "checksums, as --trust-unverified asks"
    ], err


def _older_checkpoint_loads(rank, world, tmp: Path):
    """A checkpoint in the format before train_state.json, with plain data in its pickle, still loads."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ckpt = Checkpointer(tmp, keep=2, rank=rank, device=torch.device("cpu"), trust_unverified=True)
    state = ckpt._state(model, opt)
    state["train"] = pickle.dumps({"step": 3, "scheduler": {"last_epoch": 3, "_last_lr": [1e-3]}})
    dcp.save(state, checkpoint_id=tmp / "step_00000003")
    dist.barrier()
    expected = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    train_state, warning = ckpt.load(tmp / "step_00000003", model, opt)
    assert train_state == {"step": 3, "scheduler": {"last_epoch": 3, "_last_lr": [1e-3]}}
    assert "no manifest.json" in warning
    for a, b in zip(expected, model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_older_checkpoint_with_plain_data_loads(tmp_path):
    run_ranks(_older_checkpoint_loads, 2, args=(tmp_path,))


def test_metadata_unpickler_admits_what_dcp_writes(tmp_path):
    """Every class a real DCP .metadata names is admitted (the allowlist is not too narrow)."""
    from ringflash.train.checkpoint_files import read_metadata

    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state(),
             "bf16": torch.ones(2, dtype=torch.bfloat16), "step": 3}  # fmt: skip
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    metadata = read_metadata(tmp_path)
    plain = dcp.FileSystemReader(tmp_path).read_metadata()  # pickle.load
    assert metadata.state_dict_metadata == plain.state_dict_metadata
    assert metadata.storage_data == plain.storage_data
