"""Checkpoints: stopping at k and resuming to 2k equals an uninterrupted 2k-step run, bit for bit;
old ones pruned, partial ones ignored; damaged files named by their checksums; a failed write
(a full disk) published nowhere and reported on every rank."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from ringflash.train.checkpoint import Checkpointer, CheckpointError, complete_checkpoints
from ringflash.train.config import ConfigError
from tests.dist_utils import run_ranks
from tests.tiny_config import tiny_config

K = 3  # steps before the interruption


def cfg_for(run_dir: Path, *overrides: str):
    return tiny_config(
        run_dir,
        "--data.passkey_loss=all",
        "--parallel.cp=2",
        f"--train.steps={2 * K}",
        "--train.warmup_steps=2",
        "--data.seq_len=512",
        "--data.eval_buckets=4",
        "--data.eval_samples=1",  # 2·cp buckets that hold a passkey
        *overrides,
    )


def _resume_equals_uninterrupted(rank, world, tmp: Path):
    from ringflash.train.trainer import train

    whole = train(cfg_for(tmp / "whole", "--checkpoint.enabled=false"))
    first = train(cfg_for(tmp / "split", f"--train.stop_at={K}"))
    # A new "process" would start from a different RNG state; resuming must restore it.
    torch.manual_seed(1234 + rank)
    second = train(cfg_for(tmp / "split", "--checkpoint.resume=latest"))

    assert sorted(first.losses) == list(range(1, K + 1))
    assert sorted(second.losses) == list(range(K + 1, 2 * K + 1))
    split_losses = {**first.losses, **second.losses}
    assert split_losses == whole.losses  # bit-exact floats
    for (name, a), b in zip(whole.model.state_dict().items(), second.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert whole.passkey == second.passkey
    return [p.name for p in complete_checkpoints(tmp / "split" / "checkpoints")]


def test_resume_equals_uninterrupted(tmp_path):
    saved = run_ranks(_resume_equals_uninterrupted, 2, args=(tmp_path,), timeout_s=60)
    assert saved[0] == [f"step_{K:08d}", f"step_{2 * K:08d}"]


def _fresh_run_refuses_old_checkpoints(rank, world, tmp: Path):
    from ringflash.train.trainer import train

    train(cfg_for(tmp, "--train.steps=2", "--parallel.cp=1"))
    with pytest.raises(ConfigError, match=r"already holds checkpoints .*pass --resume"):
        train(cfg_for(tmp, "--train.steps=2", "--parallel.cp=1"))
    # Resuming a finished run is a no-op that leaves its checkpoint alone (not even saved again,
    # which would replace the directory and so drop this marker).
    marker = tmp / "checkpoints" / "step_00000002" / "marker"
    marker.touch()
    assert train(cfg_for(tmp, "--train.steps=2", "--parallel.cp=1", "--checkpoint.resume=latest")).losses == {}
    assert marker.is_file()


def test_fresh_run_refuses_old_checkpoints(tmp_path):
    run_ranks(_fresh_run_refuses_old_checkpoints, 1, args=(tmp_path,))


def _keep_last_k_and_ignore_partial(rank, world, tmp: Path):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ckpt = Checkpointer(tmp, keep=2, rank=rank, device=torch.device("cpu"))
    torch.manual_seed(100 + rank)  # each rank its own RNG stream
    for step in (1, 2, 3):
        ckpt.save(step, model, opt, {"step": step})
    after_save = torch.rand(3)  # drawn from the RNG state saved with step 3
    if rank == 0:
        (tmp / "step_00000009.tmp").mkdir()  # a save that crashed: looks newer, is not complete
        (tmp / "step_00000010").mkdir()  # a copy in progress: the name, but no .metadata yet
        (tmp / "step_00000001.old").mkdir()  # a deletion that crashed
        (tmp / "step_00000001.old" / "shard").touch()
    torch.distributed.barrier()
    assert [p.name for p in complete_checkpoints(tmp)] == ["step_00000002", "step_00000003"]
    assert ckpt.resolve("latest") == tmp / "step_00000003"
    with pytest.raises(ConfigError, match=r"not a complete checkpoint"):
        ckpt.resolve(str(tmp / "step_00000009.tmp"))

    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    torch.rand(5)
    assert ckpt.load(tmp / "step_00000003", model, opt) == ({"step": 3}, None)  # None: no warning
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(torch.rand(3), after_save)  # this rank's own RNG state, restored
    ckpt.clean_partial()
    torch.distributed.barrier()
    assert not (tmp / "step_00000009.tmp").exists()
    assert not (tmp / "step_00000001.old").exists()


def test_keep_last_k_and_ignore_partial(tmp_path):
    run_ranks(_keep_last_k_and_ignore_partial, 2, args=(tmp_path,))


def _linear_and_adamw() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _flip_bytes(path: Path) -> None:
    """Invert 8 bytes in the middle of `path`: same size, still parseable, other numbers."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 8] = bytes(b ^ 0xFF for b in data[mid : mid + 8])
    path.write_bytes(bytes(data))


def _damaged_files_are_named(rank, world, tmp: Path):
    from ringflash.train.trainer import train

    train(cfg_for(tmp, "--train.steps=1"))
    step = tmp / "checkpoints" / "step_00000001"
    listed = json.loads((step / "manifest.json").read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in step.iterdir() if p.name != "manifest.json")
    assert {".metadata", "train_state.json"} < set(listed)
    resume = "--checkpoint.resume=latest"
    shard = sorted(step.glob("*.distcp"))[-1]  # the last rank's shard: every rank must still raise
    original = shard.read_bytes()
    torch.distributed.barrier()
    if rank == 0:
        _flip_bytes(shard)
    torch.distributed.barrier()
    with pytest.raises(CheckpointError, match=rf"step_00000001 is damaged: {shard.name} does not match its sha256"):
        train(cfg_for(tmp, "--train.steps=2", resume))
    torch.distributed.barrier()
    if rank == 0:
        shard.write_bytes(original)
        _flip_bytes(step / ".metadata")
    torch.distributed.barrier()
    with pytest.raises(CheckpointError, match=r"step_00000001 is damaged: .metadata does not match its sha256"):
        train(cfg_for(tmp, "--train.steps=2", resume))


def test_flipped_bytes_in_a_shard_or_metadata_are_named(tmp_path):
    """The bytes of a weight shard inverted: before manifests this loaded, and trained on, silently."""
    run_ranks(_damaged_files_are_named, 2, args=(tmp_path,), timeout_s=60)


def _no_manifest_is_refused_unless_trusted(rank, world, tmp: Path):
    model, opt = _linear_and_adamw()
    ckpt = Checkpointer(tmp, keep=2, rank=rank, device=torch.device("cpu"))
    path = ckpt.save(1, model, opt, {"step": 1})
    dist.barrier()
    if rank == 0:
        (path / "manifest.json").unlink()
    dist.barrier()
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(CheckpointError) as err:
        ckpt.load(path, model, opt)
    assert str(err.value) == (
        f"checkpoint {path} has no manifest.json, so nothing verifies its files (written before manifests existed, "
        "or not by ringflash): refused. If you trust where it came from, pass --checkpoint.trust_unverified=true "
        "to load it without checksums"
    )
    assert all(not torch.equal(a, b) for a, b in zip(saved, model.parameters()))  # nothing was loaded
    trusting = Checkpointer(tmp, keep=2, rank=rank, device=torch.device("cpu"), trust_unverified=True)
    state, warning = trusting.load(path, model, opt)
    assert state == {"step": 1}
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
    assert warning == (
        f"checkpoint {path} has no manifest.json, so nothing verifies its files: loaded without checksums, as "
        "--checkpoint.trust_unverified=true asks"
    )


def test_checkpoint_without_manifest_is_refused_unless_trusted(tmp_path):
    run_ranks(_no_manifest_is_refused_unless_trusted, 2, args=(tmp_path,))


class _FullDisk(FileSystemWriter):
    """DCP's writer on a disk that is full for rank 1."""

    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write_data(plan, planner)


def _full_disk(rank, world, tmp: Path):
    model, opt = _linear_and_adamw()
    Checkpointer(tmp, keep=2, rank=rank, device=torch.device("cpu")).save(1, model, opt, {"step": 1})
    full = Checkpointer(tmp, keep=2, rank=rank, device=torch.device("cpu"), writer=_FullDisk)
    with pytest.raises(CheckpointError) as err:
        full.save(2, model, opt, {"step": 2})
    dist.barrier()
    assert [p.name for p in complete_checkpoints(tmp)] == ["step_00000001"]  # nothing published
    return str(err.value)


def test_full_disk_is_one_line_on_every_rank_and_publishes_nothing(tmp_path):
    for msg in run_ranks(_full_disk, 2, args=(tmp_path,)):
        assert msg == (
            f"saving checkpoint {tmp_path / 'step_00000002'} failed: OSError: [Errno 28] No space left on device "
            "(nothing was published)"
        ), msg


def _damaged_manifest_or_missing_file(rank, world, tmp: Path):
    model, opt = _linear_and_adamw()
    ckpt = Checkpointer(tmp, keep=2, rank=rank, device=torch.device("cpu"))
    path = ckpt.save(1, model, opt, {"step": 1})
    manifest = json.loads((path / "manifest.json").read_text())
    shard = sorted(path.glob("*.distcp"))[0]
    files = manifest["files"]
    cases = [
        ("{not json", r"manifest.json is damaged \(JSONDecodeError: "),
        (json.dumps({"files": {"../x": {"sha256": "0"}}}), r"manifest.json is damaged .*not a file of the checkpoint"),
        (json.dumps({"files": {**files, "__9_0.distcp": {"sha256": "0"}}}), r"incomplete: __9_0.distcp .* missing"),
        (json.dumps({"files": {**files, shard.name: {"sha256": "0" * 64}}}), rf"damaged: {shard.name} does not match"),
    ]
    for text, match in cases:
        (path / "manifest.json").write_text(text)
        with pytest.raises(CheckpointError, match=rf"checkpoint {path}.*{match}"):
            ckpt.load(path, model, opt)


def test_damaged_manifest_or_missing_file_is_named(tmp_path):
    run_ranks(_damaged_manifest_or_missing_file, 1, args=(tmp_path,))
