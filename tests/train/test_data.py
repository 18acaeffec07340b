"""Data sources and the sampler: passkey layout, determinism, exact resumption, clear errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ringflash.train.config import ConfigError, DataConfig
from ringflash.train.data import FILLER, IGNORE, QUERY, DataLoader, PasskeyTask, _holds, build_source, build_sources


def passkey(**kw) -> PasskeyTask:
    return PasskeyTask(DataConfig(**{"seq_len": 512, "eval_buckets": 4, **kw}))


def text(t: torch.Tensor) -> str:
    return bytes(t.to(torch.uint8).tolist()).decode()


def test_passkey_sample_layout():
    task = passkey()
    x, y = task(3)
    assert x.shape == y.shape == (512,) and x.dtype == torch.int64
    seq = text(torch.cat([x, y[-1:]]))
    key = seq[-task.digits :]
    assert key.isdigit() and seq.endswith(QUERY + key)
    assert seq.count(f"#{key}") == 3  # twice in the key sentence, once as the answer
    # Loss only on the answer digits by default: each label predicts the next key digit.
    assert (y[: -task.digits] == IGNORE).all()
    assert text(y[-task.digits :]) == key


def test_passkey_loss_on_all_tokens():
    x, y = passkey(passkey_loss="all")(3)
    torch.testing.assert_close(x[1:], y[:-1])


def test_passkey_is_deterministic_and_varied():
    task = passkey()
    a, b = task(5), task(5)
    assert torch.equal(a[0], b[0])
    samples = [text(task(i)[0]) for i in range(20)]
    assert len(set(samples)) == 20
    assert len({s.index("#") for s in samples}) > 10  # keys at many depths
    assert len({s[:10] for s in samples}) > 5  # filler starts at many phases
    assert any(s.startswith(FILLER[:10]) is False for s in samples)


def test_passkey_eval_buckets_cover_every_depth():
    task = passkey(eval_buckets=8, seq_len=1024)
    for b in range(8):
        for s in task.eval_set(b, 4):
            assert s.bucket == b
            assert b * 1024 / 8 <= s.key_pos < (b + 1) * 1024 / 8
            assert text(s.tokens[s.key_pos : s.key_pos + task.digits]) == text(s.tokens[-task.digits :])
    # Every feasible key position of a bucket, its first and last included, lies in that bucket.
    for b in range(8):
        positions = task.key_range(b)
        assert {p * task.buckets // task.L for p in positions} == {b}, (b, positions)
    # Fixed: the same evaluation set every time it is asked for.
    assert torch.equal(task.eval_set(2, 3)[1].tokens, task.eval_set(2, 3)[1].tokens)


def test_passkey_too_short_for_buckets():
    with pytest.raises(ConfigError, match=r"too short for passkey with 8 buckets"):
        passkey(seq_len=512, eval_buckets=8)


def test_passkey_too_short_names_every_knob():
    # A long key alone can make the sequence too short: the message must offer passkey_digits too.
    with pytest.raises(ConfigError, match=r"too short for passkey .* or data.passkey_digits \(200\)"):
        passkey(seq_len=512, eval_buckets=1, passkey_digits=200)
    assert passkey(seq_len=512, eval_buckets=1, passkey_digits=100).digits == 100


def test_loader_splits_dp_and_resumes_exactly():
    task = passkey()
    ranks = [DataLoader(task, batch_size=2, grad_accum=2, dp_rank=r, dp_size=2) for r in range(2)]
    seen = set()
    for loader in ranks:
        for _ in range(3):
            for x, _ in loader.next():
                seen.update(text(row) for row in x)
    assert len(seen) == 3 * 2 * 2 * 2  # steps × accum × dp × batch, all distinct

    a = DataLoader(task, 2, 2, 0, 2)
    a.next()
    b = DataLoader(task, 2, 2, 0, 2)
    b.load_state_dict(a.state_dict())
    for (xa, ya), (xb, yb) in zip(a.next(), b.next(), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)

    # Another batch geometry (another world size) continues from the global sample index: with the
    # same global batch (dp halved, grad_accum doubled) every step draws the same set of samples.
    whole = [DataLoader(task, 2, 2, r, 2) for r in range(2)]
    expect = [{text(row) for loader in whole for x, _ in loader.next() for row in x} for _ in range(3)]
    saved = whole[0].state_dict() | {"step": 1, "sample": 8}  # as saved after step 1 of 3 (G = 8)
    for other in [(2, 4, 0, 1), (1, 2, 0, 4), (4, 1, 0, 2)]:
        c_ranks = [DataLoader(task, *other[:2], r, other[3]) for r in range(other[3])]
        for loader in c_ranks:
            loader.load_state_dict(saved)
        for step in (1, 2):
            assert {text(row) for loader in c_ranks for x, _ in loader.next() for row in x} == expect[step]


def test_text_file_and_directory(tmp_path):
    body = ("hello ringflash " * 64).encode()
    (tmp_path / "a.txt").write_bytes(body)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(body)
    for path in (tmp_path / "a.txt", tmp_path):
        src = build_source(DataConfig(kind="text", path=str(path), seq_len=64), 256)
        x, y = src(0)
        assert x.shape == (64,)
        torch.testing.assert_close(x[1:], y[:-1])
        assert text(x) in (body * 2).decode()


def test_bin_tokens(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 300
    tokens.tofile(tmp_path / "train.bin")
    src = build_source(DataConfig(kind="bin", path=str(tmp_path), seq_len=32), 300)
    x, y = src(7)
    assert int(x[1]) == (int(x[0]) + 1) % 300
    torch.testing.assert_close(x[1:], y[:-1])
    np.full(100, 299, dtype=np.uint16).tofile(tmp_path / "big.bin")
    # Raised when the source is built (on every rank alike), not when the bad window is drawn.
    with pytest.raises(ConfigError, match=r"holds token 299 but model.vocab_size is 256"):
        build_source(DataConfig(kind="bin", path=str(tmp_path / "big.bin"), seq_len=32), 256)
    # Ids run from 0 to vocab_size - 1: vocab_size itself is already out of range.
    with pytest.raises(ConfigError, match=r"holds token 299 but model.vocab_size is 299"):
        build_source(DataConfig(kind="bin", path=str(tmp_path / "big.bin"), seq_len=32), 299)
    assert build_source(DataConfig(kind="bin", path=str(tmp_path / "big.bin"), seq_len=32), 300)(0)[0].max() == 299


def test_shortest_usable_file(tmp_path):
    # seq_len + 1 tokens make exactly one window, which every index draws; seq_len tokens make none.
    tokens = np.arange(65, dtype=np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    src = build_source(DataConfig(kind="bin", path=str(tmp_path), seq_len=64), 256)
    for i in range(20):
        x, y = src(i)
        assert x.tolist() == list(range(64)) and y.tolist() == list(range(1, 65))
    tokens[:64].tofile(tmp_path / "train.bin")
    with pytest.raises(ConfigError, match=r"holds 64 tokens, fewer than data.seq_len \+ 1 = 65"):
        build_source(DataConfig(kind="bin", path=str(tmp_path), seq_len=64), 256)


@pytest.mark.parametrize(
    "kind, make, match",
    [
        ("text", lambda d: d / "missing.txt", "does not exist"),
        ("text", lambda d: d, "holds no files"),
        ("text", lambda d: _write(d / "short.txt", b"abc"), "holds 3 tokens, fewer than"),
        ("bin", lambda d: d / "missing", "does not exist"),
        ("bin", lambda d: d, "has no train.bin"),
        ("bin", lambda d: _write(d / "odd.bin", b"abc"), "odd number of bytes"),
        ("text", lambda d: _write(d / "empty.txt", b""), "empty.txt holds 0 tokens, fewer than"),
        ("bin", lambda d: _write(d / "empty.bin", b""), "empty.bin holds 0 tokens, fewer than"),
    ],
)
def test_bad_data_paths(tmp_path, kind, make, match):
    path = make(tmp_path)
    with pytest.raises(ConfigError, match=match):
        build_source(DataConfig(kind=kind, path=str(path), seq_len=64), 256)


@pytest.mark.parametrize("kind", ["text", "bin"])
def test_unreadable_data_file_names_it(tmp_path, monkeypatch, kind):
    path = _write(tmp_path / "locked.bin", b"\0" * 512)

    def denied(filename, *args, **kwargs):  # what chmod 000 does for anyone but root
        raise PermissionError(13, "Permission denied", str(filename))

    monkeypatch.setattr(np, "memmap", denied)
    with pytest.raises(ConfigError, match=r"data.path: cannot read .*locked.bin: Permission denied"):
        build_source(DataConfig(kind=kind, path=str(path), seq_len=64), 256)


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_passkey_loss_on_digits():
    task = passkey(passkey_loss="digits")
    x, y = task(11)
    seq = text(torch.cat([x, y[-1:]]))
    key = seq[-task.digits :]
    kept = (y != IGNORE).nonzero().flatten().tolist()
    assert len(kept) == 2 * task.digits
    assert text(y[kept]) == key + key  # the key's repetition, then the answer
    second = seq.index(f"#{key}", seq.index(f"#{key}") + 1) + 1  # first digit of the repetition
    assert kept[0] == second - 1  # the label at i predicts token i + 1


def test_passkey_repetition_gap_varies():
    task = passkey(passkey_gap=16)
    rng = random.Random(0)
    offsets = {(s.repeat_pos[0] - s.key_pos) for s in (task.make(rng, 100) for _ in range(50))}
    assert len(offsets) > 8  # no fixed offset to learn instead of the key's content
    task = passkey(passkey_gap=16, passkey_repeats=3, eval_buckets=2, passkey_loss="digits")
    for s in (task.make(rng, 200) for _ in range(5)):
        assert len(s.tokens) == 513 and len(s.repeat_pos) == 3
        for pos in s.repeat_pos:
            assert torch.equal(s.tokens[pos : pos + 5], s.tokens[s.key_pos : s.key_pos + 5])
        assert (task.labels(s) != IGNORE).sum() == 4 * task.digits


def test_sequence_length_warmup():
    cfg = DataConfig(seq_len=512, eval_buckets=4, warmup_seq_len=128, warmup_seq_steps=2)
    source, short = build_sources(cfg, 256)
    loader = DataLoader(source, 2, 1, 0, 1, short, cfg.warmup_seq_steps)
    lengths = [loader.next()[0][0].shape[1] for _ in range(4)]
    assert lengths == [128, 128, 512, 512]
    assert text(short(0)[0]).count("#") >= 2  # a whole passkey sequence, at the short length
    resumed = DataLoader(source, 2, 1, 0, 1, short, cfg.warmup_seq_steps)
    resumed.load_state_dict({**loader.state_dict(), "step": 1})
    assert resumed.next()[0][0].shape[1] == 128

    with pytest.raises(ConfigError, match=r"data.warmup_seq_len \(64\): data.seq_len \(64\) too short"):
        build_sources(DataConfig(seq_len=512, eval_buckets=4, warmup_seq_len=64, warmup_seq_steps=1), 256)


def _check_packed(x, y, doc, eod):
    """Document ids step by one right after each EOD input; labels across a boundary are IGNORE."""
    ends = x == eod
    assert int(doc[0]) == 0 and torch.equal(doc[1:] - doc[:-1], ends[:-1].long())
    assert (y[ends] == IGNORE).all()  # the next document's first token: not predictable
    torch.testing.assert_close(x[1:][~ends[:-1]], y[:-1][~ends[:-1]])  # elsewhere the next token, EOD included


def test_packed_text_directory_is_one_document_per_file(tmp_path):
    # Each file one letter, of its own length; b already ends with the EOD byte; c holds one inside.
    (tmp_path / "a.txt").write_bytes(b"a" * 11)
    (tmp_path / "b.txt").write_bytes(b"b" * 5 + b"\0")
    (tmp_path / "c.txt").write_bytes(b"c" * 7 + b"\0" + b"d" * 9)
    src = build_source(DataConfig(kind="text", path=str(tmp_path), seq_len=24, pack_documents=True), 256)
    assert src.tokens.tobytes() == b"a" * 11 + b"\0" + b"b" * 5 + b"\0" + b"c" * 7 + b"\0" + b"d" * 9 + b"\0"
    for i in range(20):
        x, y, doc = src(i)
        assert x.shape == y.shape == doc.shape == (24,) and doc.dtype == torch.int64
        _check_packed(x, y, doc, 0)
        for d in doc.unique():
            assert len(set(text(x[(doc == d) & (x != 0)]))) <= 1  # one file's letter per document
    assert any(int(src(i)[2][-1]) >= 2 for i in range(20))
    x, y, doc = src(3)
    again = build_source(DataConfig(kind="text", path=str(tmp_path), seq_len=24, pack_documents=True), 256)(3)
    assert all(torch.equal(a, b) for a, b in zip((x, y, doc), again, strict=True))  # a pure function of the index
    # An EOD token outside the bytes (vocab 257) cannot occur in text: only the files separate.
    src = build_source(DataConfig(kind="text", path=str(tmp_path), seq_len=24, pack_documents=True, eod_token=256), 257)
    assert int((torch.from_numpy(src.tokens.astype(np.int64)) == 256).sum()) == 3
    _check_packed(*src(0), 256)


def test_packed_bin_uses_gpt2_end_of_text(tmp_path):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 50000, rng.integers(1, 40)), 50256) for _ in range(50)]
    np.concatenate(docs).astype(np.uint16).tofile(tmp_path / "train.bin")
    src = build_source(DataConfig(kind="bin", path=str(tmp_path), seq_len=64, pack_documents=True), 50304)
    for i in range(10):
        _check_packed(*src(i), 50256)
    loader = DataLoader(src, batch_size=3, grad_accum=2, dp_rank=0, dp_size=1)
    micros = loader.next()
    assert len(micros) == 2 and all(len(m) == 3 and m[2].shape == (3, 64) for m in micros)
    resumed = DataLoader(src, 3, 2, 0, 1)
    resumed.load_state_dict(loader.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(loader.next()[1], resumed.next()[1], strict=True))


def test_eod_found_in_any_chunk():
    # The corpus is searched chunk by chunk (a memory map is never compared whole): the first EOD
    # may sit in any chunk, the last one included.
    tokens = np.array([5, 6, 7, 8, 9, 1, 2], dtype=np.uint16)
    assert [_holds(tokens, v, chunk=2) for v in (5, 8, 2, 3)] == [True, True, True, False]


def test_packed_text_without_any_eod_is_an_error(tmp_path):
    path = _write(tmp_path / "one.txt", b"no separator here " * 10)
    with pytest.raises(ConfigError, match=r"data.eod_token: text .*one.txt never holds the end-of-document token 0"):
        build_source(DataConfig(kind="text", path=str(path), seq_len=64, pack_documents=True), 256)


def _data_error(rank, world, path, only_rank):
    """The error `train` raises on this rank when the data cannot be read on `only_rank` (None: on every rank)."""
    import ringflash.train.trainer as trainer
    from tests.tiny_config import tiny_config

    if only_rank is not None and rank != only_rank:  # this rank reads its own copy of the files
        real = trainer.build_sources
        trainer.build_sources = lambda d, v: real(DataConfig(**{**d.__dict__, "path": "@stdlib"}), v)
    try:
        trainer.train(tiny_config(None, "--data.kind=text", f"--data.path={path}", "--parallel.cp=2"))
    except ConfigError as e:
        return str(e), getattr(e, "agreed", False)
    return None


@pytest.mark.parametrize("only_rank", [None, 1])
def test_data_missing_on_some_ranks_stops_every_rank_with_one_agreed_error(tmp_path, only_rank):
    # Every rank raises the same error, marked agreed (launch/train.py prints it once, from rank 0),
    # naming the ranks that lacked the data unless all did; no rank goes on to train alone.
    from tests.dist_utils import run_ranks

    missing = tmp_path / "nowhere"
    said = f"data.path: {missing} does not exist (data.kind = 'text')"
    expected = (said if only_rank is None else f"on rank 1: {said}", True)
    assert run_ranks(_data_error, 2, args=(missing, only_rank), timeout_s=120) == [expected, expected]
