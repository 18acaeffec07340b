"""Real text: the document list and its held-out split, file boundaries as the ring's mask,
held-out bits per byte, and the configs that train on the standard library."""

from __future__ import annotations

import math
import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ringflash.train.config import ConfigError, DataConfig, load_config
from ringflash.train.data import (
    IGNORE,
    NOT_STDLIB,
    build_heldout,
    build_source,
    corpora,
    document_files,
    is_heldout,
)
from ringflash.train.heldout import bits_per_byte
from tests.dist_utils import REPO, run_ranks
from tests.tiny_config import tiny_config


def write_tree(root: Path, n: int = 40, seed: int = 0) -> dict[str, bytes]:
    """`n` files of random letters (no NUL) and random lengths, in nested directories, plus a
    file the glob below leaves out; returns {relative path: content} of the .txt files."""
    rng = random.Random(seed)
    files = {}
    for i in range(n):
        rel = f"d{i % 3}/{'sub/' if i % 2 else ''}f{i:02d}.txt"
        files[rel] = "".join(rng.choice("abcdefghij \n") for _ in range(rng.randint(20, 300))).encode()
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(files[rel])
    (root / "d0" / "skip.bin").write_bytes(b"\x00\x01binary")
    return files


def text_cfg(root: Path, **kw) -> DataConfig:
    return DataConfig(**{"kind": "text", "path": str(root), "files": "**/*.txt", "pack_documents": True,
                         "heldout": 0.25, "seq_len": 256, **kw})


def test_document_list_is_sorted_relative_paths_and_split_by_path_hash(tmp_path):
    files = write_tree(tmp_path)
    rels = document_files(tmp_path, "**/*.txt")
    assert rels == sorted(files)  # every .txt file, no other, in string order of the relative path
    held = [r for r in rels if is_heldout(r, 0.25)]
    assert 0 < len(held) < len(rels)
    # The side of a file is a function of its path alone: other files appearing or vanishing (a
    # machine with a slightly different set) move no file across the split.
    (tmp_path / "d1" / "extra.txt").write_bytes(b"more text")
    (tmp_path / rels[0]).unlink()
    now = document_files(tmp_path, "**/*.txt")
    assert [r for r in now if is_heldout(r, 0.25) and r != "d1/extra.txt"] == [r for r in held if r != rels[0]]
    # A larger fraction holds out a superset; 0 none.
    assert set(held) <= {r for r in rels if is_heldout(r, 0.5)} and not any(is_heldout(r, 0.0) for r in rels)
    # The fraction held out follows the setting over many names.
    names = [f"lib/module_{i}.py" for i in range(4000)]
    assert abs(sum(is_heldout(r, 0.1) for r in names) / len(names) - 0.1) < 0.02


def test_corpora_hold_each_file_once_in_order(tmp_path):
    files = write_tree(tmp_path)
    train, held = corpora(text_cfg(tmp_path))
    for corpus, side in ((train, False), (held, True)):
        part = [r for r in sorted(files) if is_heldout(r, 0.25) == side]
        assert corpus.tokens.tobytes() == b"".join(files[r] + b"\0" for r in part)
        assert (corpus.files, corpus.bytes) == (len(part), sum(len(files[r]) for r in part))


def test_file_boundaries_become_the_mask(tmp_path):
    files = write_tree(tmp_path)
    cfg = text_cfg(tmp_path)
    source, heldout = build_source(cfg, 256), build_heldout(cfg, 256)
    for windows in (source, heldout):
        # The file of every position of the corpus, from the files' own lengths.
        lengths = [len(files[r]) + 1 for r in sorted(files) if is_heldout(r, 0.25) == (windows is heldout)]
        file_of = np.repeat(np.arange(len(lengths)), lengths)
        for start in windows.spread(6) + [random.Random(i).randrange(len(windows.tokens) - 256) for i in range(6)]:
            x, y, doc = windows.window(start)
            owner = torch.from_numpy(file_of[start : start + 256])
            # Two positions share a document id exactly when they come from the same file, so the
            # ring's document mask (built from these ids) never lets a token see another file.
            assert torch.equal(doc.unsqueeze(0) == doc.unsqueeze(1), owner.unsqueeze(0) == owner.unsqueeze(1))
            assert int(doc[0]) == 0 and bool((doc[1:] - doc[:-1] <= 1).all())
            # No loss across a boundary: the label of each file's EOD is its successor's first byte.
            assert torch.equal(y == IGNORE, x == 0)


def _ring_masks(rank, world, cfg, doc_ids, file_ids):
    """(documents, fingerprint) of this rank's ring mask from the source's ids and from the files'."""
    from ringflash.train.parallel import attention_mask, distributed

    with distributed(cfg.parallel, "cpu") as pc:
        a, b = (attention_mask(ids, ids.shape[1], pc, cfg.parallel.layout) for ids in (doc_ids, file_ids))
        return (a.n_docs, a.fingerprint), (b.n_docs, b.fingerprint)


def test_ring_mask_holds_the_file_boundaries(tmp_path):
    files = write_tree(tmp_path, n=12)
    cfg = tiny_config(None, "--parallel.cp=2", "--data.kind=text", f"--data.path={tmp_path}", "--data.files=**/*.txt",
                      "--data.pack_documents=true", "--data.seq_len=512")  # fmt: skip
    _, _, doc = build_source(cfg.data, 256).window(0)  # the corpus's first 512 bytes: whole files, then a part
    file_ids = torch.from_numpy(np.repeat(np.arange(len(files)), [len(files[r]) + 1 for r in sorted(files)])[:512])
    # The mask's fingerprint hashes the document starts (cu_seqlens) of every row: equal fingerprints,
    # equal boundaries, so each rank's ring mask cuts the sequence exactly at the file boundaries.
    for from_source, from_files in run_ranks(_ring_masks, 2, args=(cfg, doc.unsqueeze(0), file_ids.unsqueeze(0))):
        assert from_source == from_files and from_source[0] == int(file_ids[-1]) + 1 >= 3


def test_stdlib_corpus_is_the_standard_library():
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = document_files(root, "**/*.py", stdlib=True)
    assert "os.py" in rels and "json/__init__.py" in rels
    assert not any(r.split("/")[0] in NOT_STDLIB for r in rels)
    assert rels == sorted(rels) and all(r.endswith(".py") for r in rels)


def test_bits_per_byte_by_hand():
    # Two bytes predicted with probabilities 1/2 and 1/8: 1 + 3 = 4 bits, 2 bits per byte.
    assert bits_per_byte(math.log(2) + math.log(8), 2) == pytest.approx(2.0, rel=1e-12)
    # Against cross-entropy on random logits, in float64: bits per byte is the mean nats over ln 2.
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(50, 256, generator=g, dtype=torch.float64), torch.randint(0, 256, (50,), generator=g)
    labels[::7] = IGNORE
    nats = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    p = torch.softmax(logits, -1)[torch.arange(50), labels.clamp(min=0)]
    by_hand = -torch.log2(p[labels != IGNORE]).mean()
    assert bits_per_byte(float(nats), int((labels != IGNORE).sum())) == pytest.approx(float(by_hand), rel=1e-12)
    with pytest.raises(ValueError, match=r"^n_tokens: must be > 0, got 0$"):
        bits_per_byte(1.0, 0)


def test_single_file_and_nanogpt_heldout(tmp_path):
    (tmp_path / "one.txt").write_bytes(bytes(range(1, 201)) * 5)  # 1000 bytes
    train, held = corpora(DataConfig(kind="text", path=str(tmp_path / "one.txt"), heldout=0.2, seq_len=64))
    assert (len(train.tokens), len(held.tokens), train.bytes + held.bytes) == (800, 200, 1000)
    assert held.tokens.tobytes() == (bytes(range(1, 201)) * 5)[800:]
    tokens = np.arange(600, dtype=np.uint16) % 300
    tokens.tofile(tmp_path / "train.bin")
    tokens[::-1].copy().tofile(tmp_path / "val.bin")
    train, held = corpora(DataConfig(kind="bin", path=str(tmp_path), heldout=0.1, seq_len=64))
    assert np.array_equal(train.tokens, tokens) and np.array_equal(held.tokens, tokens[::-1])  # val.bin, whole


def test_heldout_errors(tmp_path):
    write_tree(tmp_path, n=3)
    with pytest.raises(ConfigError, match=r"^data.heldout \(0.01\) holds out 0 of the 3 files of .*: both parts need"):
        corpora(text_cfg(tmp_path, heldout=0.01))
    with pytest.raises(ConfigError, match=r"^data.path: directory .* holds no files matching data.files = '\*.md'$"):
        corpora(text_cfg(tmp_path, files="*.md"))
    with pytest.raises(ConfigError, match=r"^data.heldout: must be in \[0, 1\), got 1.0$"):
        load_config(None, ["--data.kind=text", f"--data.path={tmp_path}", "--data.heldout=1"])
    with pytest.raises(ConfigError, match=r"^data.heldout: needs data.kind = text or bin \(a passkey task has"):
        load_config(None, ["--data.heldout=0.1"])
    with pytest.raises(ConfigError, match=r"^data.path = @stdlib: needs data.kind = text, got 'bin'$"):
        load_config(None, ["--data.kind=bin", "--data.path=@stdlib"])


@pytest.mark.parametrize("name", ["text_cpu", "gpu2_text"])
def test_text_configs_load_and_validate(name):
    cfg = load_config(REPO / "configs" / f"{name}.toml")
    d = cfg.data
    assert (d.kind, d.path, d.files, d.pack_documents) == ("text", "@stdlib", "**/*.py", True)
    assert 0 < d.heldout < 1 and d.eval_samples > 0 and cfg.train.eval_every > 0 and cfg.parallel.cp == 2


def _heldout_in_ranks(rank, world, cfg):
    from ringflash.train.trainer import train

    return train(cfg).heldout


def test_trainer_scores_heldout_text(tmp_path):
    write_tree(tmp_path / "docs", n=60)
    cfg = tiny_config(tmp_path / "run", "--parallel.cp=2", "--data.kind=text", f"--data.path={tmp_path / 'docs'}",
                      "--data.files=**/*.txt", "--data.pack_documents=true", "--data.heldout=0.3",
                      "--data.eval_samples=3", "--train.steps=4", "--train.eval_every=2", "--train.lr=1e-2",
                      "--checkpoint.enabled=false")  # fmt: skip
    curves = run_ranks(_heldout_in_ranks, 2, args=(cfg,))
    assert curves[0] == curves[1] and sorted(curves[0]) == [0, 2, 4]  # step 0, every 2 steps, the end
    assert 7.0 < curves[0][0] < 8.5  # an untrained byte model: near log2(256) = 8 bits
    assert curves[0][4] < curves[0][0]
