"""Training data: a synthetic passkey task (the default), a synthetic recall task (a needle in random
letters, `RecallTask`), byte-level text (any directory of files, or the installed Python standard
library: `data.path = "@stdlib"`), nanoGPT token files; and the held-out part of a text or token
corpus (`data.heldout`, `build_heldout`), which training never draws from.

Every source maps a sample index to one sequence, `(inputs (L,), labels (L,))` int64, labels
shifted by one and -100 where no loss is taken. With `data.pack_documents` a text or bin source
returns `(inputs, labels, doc_ids)`: `doc_ids (L,)` int64, non-decreasing from 0, the document of
each input position of the whole (unsharded) sequence; an end-of-document (EOD) token belongs to the
document it ends. The DataLoader stacks whatever the source returns, so a batch is `(inputs,
labels)` or `(inputs, labels, doc_ids)`, each `(B, L)`. `DataLoader` turns (step, micro-step, dp rank)
into sample indices, so a batch is a pure function of the seed and the step: resuming needs only
the step, and every cp rank of a dp group builds the same global sequences before taking its shard.

The passkey task (Mohtashami & Jaggi, 2023): a pass key hidden at some depth of a long, repetitive
filler, asked for at the very end:

    ...The sun is yellow. Here we go. The pass key is #71432. Remember it. There and back
    #71432 is the pass key. again. The grass is green. ... What is the pass key? The pass key is #71432

Only the digits are unpredictable from local context: the key's first occurrence is random, and
its repetition (a few bytes later) and the final answer (up to the whole sequence later) must be
copied from it. A model that answers has learned to attend across the whole sequence, and so
across every cp rank's shard.
"""

from __future__ import annotations

import hashlib
import math
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ringflash.train.config import STDLIB, ConfigError, DataConfig, resolve_eod_token
from ringflash.train.config_schema import warmup_data
from ringflash.train.passkey_format import FILLER, KEY, QUERY, REPEAT, check_passkey_fits

IGNORE = -100  # label of positions that take no loss (F.cross_entropy's ignore_index)
# Under the standard library's directory but not part of it: third-party packages, which differ by machine.
NOT_STDLIB = ("site-packages", "dist-packages")


def _bytes(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(s.encode()), dtype=torch.uint8).long()


@dataclass
class PasskeySample:
    tokens: torch.Tensor  # (L + 1,) int64 bytes; the last `digits` tokens are the answer
    key_pos: int  # position of the key's first digit in the sequence
    repeat_pos: tuple[int, ...]  # positions of the first digit of each repetition of the key
    bucket: int  # depth bucket of key_pos: floor(key_pos · buckets / L)


class PasskeyTask:
    """Byte-level passkey retrieval sequences of `seq_len + 1` tokens (vocab 256)."""

    def __init__(self, cfg: DataConfig):
        self.L, self.digits, self.buckets = cfg.seq_len, cfg.passkey_digits, cfg.eval_buckets
        self.loss_on, self.seed = cfg.passkey_loss, cfg.seed
        self.answer_len = self.digits  # what evaluation scores: the last answer_len tokens
        self.gap, self.repeats = cfg.passkey_gap, cfg.passkey_repeats
        self.key_len = len(KEY.format(key="0" * self.digits))
        self.repeat_len = len(REPEAT.format(key="0" * self.digits))
        self.prefix_len = KEY.index("#") + 1  # key sentence bytes before the first digit
        self.tail_len = len(QUERY) + self.digits
        self.filler_len = self.L + 1 - self.key_len - self.repeats * self.repeat_len - self.tail_len
        check_passkey_fits(cfg)
        reps = math.ceil((self.filler_len + len(FILLER)) / len(FILLER))
        self.filler = _bytes(FILLER * reps)

    def make(self, rng: random.Random, key_pos: int) -> PasskeySample:
        """The sequence whose key's first digit sits at `key_pos`, filler and key drawn from `rng`."""
        key = "".join(rng.choice("0123456789") for _ in range(self.digits))
        phase = rng.randrange(len(FILLER))  # so that absolute position says nothing about the filler
        filler = self.filler[phase : phase + self.filler_len]
        at = key_pos - self.prefix_len
        parts, repeat_pos = [filler[:at], _bytes(KEY.format(key=key))], []
        cursor, end = at, at + self.key_len  # next filler byte to use; sequence length so far
        for _ in range(self.repeats):
            # A random gap before each repetition: copying it then needs the key's content, not a
            # fixed offset, which is the same skill the final answer needs at any distance.
            gap = rng.randint(0, self.gap)
            parts += [filler[cursor : cursor + gap], _bytes(REPEAT.format(key=key))]
            repeat_pos.append(end + gap + 1)
            cursor, end = cursor + gap, end + gap + self.repeat_len
        parts += [filler[cursor:], _bytes(QUERY + key)]
        return PasskeySample(torch.cat(parts), key_pos, tuple(repeat_pos), key_pos * self.buckets // self.L)

    def key_range(self, bucket: int | None = None) -> range:
        """Feasible first-digit positions, optionally restricted to one depth bucket."""
        lo, hi = self.prefix_len, self.prefix_len + self.filler_len - self.repeats * self.gap
        if bucket is not None:
            lo = max(lo, math.ceil(bucket * self.L / self.buckets))
            hi = min(hi, math.ceil((bucket + 1) * self.L / self.buckets) - 1)
        return range(lo, hi + 1)

    def labels(self, sample: PasskeySample) -> torch.Tensor:
        """Next-token labels `(L,)`, IGNORE except where `data.passkey_loss` takes a loss."""
        labels = sample.tokens[1:].clone()
        if self.loss_on == "all":
            return labels
        keep = torch.zeros_like(labels, dtype=torch.bool)
        keep[-self.digits :] = True  # the answer
        if self.loss_on == "digits":
            # The key's repetitions: the same retrieval at short range.
            for pos in sample.repeat_pos:
                keep[pos - 1 : pos - 1 + self.digits] = True  # the label at i predicts token i + 1
        return labels.masked_fill(~keep, IGNORE)

    def __call__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = random.Random(f"passkey:{self.seed}:{index}")
        sample = self.make(rng, rng.choice(self.key_range()))
        return sample.tokens[:-1], self.labels(sample)

    def eval_set(self, bucket: int, n: int) -> list[PasskeySample]:
        """`n` fixed evaluation sequences with keys spread evenly over depth bucket `bucket`."""
        rng = random.Random(f"passkey-eval:{self.seed}:{bucket}")
        positions = self.key_range(bucket)
        return [self.make(rng, positions[(2 * i + 1) * len(positions) // (2 * n)]) for i in range(n)]


@dataclass
class RecallSample:
    tokens: torch.Tensor  # (L + 1,) int64 bytes; the last `digits` tokens are the answer
    key_pos: int  # position of the value's first digit after the marker inside the haystack
    bucket: int  # depth bucket of key_pos: floor(key_pos · buckets / L)


class RecallTask:
    """A needle in a haystack of random letters: a marker and a random value, at some depth, asked
    for at the very end (`seq_len + 1` bytes):

        qhzkwpjvbe@37tyxmcoalpwqdunr ... fjsiqgebkcmw@37
                  ^ key_pos                          ^ the answer: the last `digits` bytes

    The passkey task without its sentences: the haystack is unpredictable, so the loss is taken
    on the answer alone, and the answer can only come from the needle's copy (the marker never
    occurs in the haystack, the digits never outside the value). The answer is predicted on the
    cp rank that holds the sequence's end; a needle on another rank is found only through the ring.

    Training samples come from the random stream `recall:<seed>:<index>`, evaluation samples from
    `recall-eval:<seed>:<bucket>`: each evaluation sequence has a value and haystack of its own.
    """

    MARKER, LETTERS, DIGITS = "@", "abcdefghijklmnopqrstuvwxyz", "0123456789"

    def __init__(self, cfg: DataConfig, digits: int = 2):
        self.L, self.buckets, self.seed, self.digits = cfg.seq_len, cfg.eval_buckets, cfg.seed, digits
        self.answer_len = digits  # what evaluation scores: the last answer_len tokens
        if self.L // self.buckets < 2 * (digits + 1):
            raise ConfigError(
                f"data.seq_len ({self.L}) too short for recall with {self.buckets} buckets: each bucket "
                f"({self.L // self.buckets} tokens) must hold the needle and the query ({2 * (digits + 1)} tokens)"
            )

    def make(self, rng: random.Random, key_pos: int) -> RecallSample:
        """The sequence whose value's first digit sits at `key_pos`, haystack and value drawn from `rng`."""
        value = "".join(rng.choice(self.DIGITS) for _ in range(self.digits))
        hay = "".join(rng.choice(self.LETTERS) for _ in range(self.L + 1))
        needle = self.MARKER + value
        at = key_pos - 1  # the marker's position
        seq = hay[:at] + needle + hay[at + len(needle) : self.L - self.digits] + needle
        return RecallSample(_bytes(seq), key_pos, key_pos * self.buckets // self.L)

    def key_range(self, bucket: int | None = None) -> range:
        """Feasible first-digit positions (the needle ends before the query), optionally in one depth
        bucket, with the whole needle inside it."""
        lo, hi = 1, self.L - 2 * self.digits - 1
        if bucket is not None:
            lo = max(lo, math.ceil(bucket * self.L / self.buckets) + 1)
            hi = min(hi, math.ceil((bucket + 1) * self.L / self.buckets) - self.digits)
        return range(lo, hi + 1)

    def labels(self, sample: RecallSample) -> torch.Tensor:
        """Next-token labels `(L,)`: IGNORE except on the answer."""
        labels = sample.tokens[1:].clone()
        labels[: -self.digits] = IGNORE
        return labels

    def __call__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = random.Random(f"recall:{self.seed}:{index}")
        sample = self.make(rng, rng.choice(self.key_range()))
        return sample.tokens[:-1], self.labels(sample)

    def eval_set(self, bucket: int, n: int) -> list[RecallSample]:
        """`n` fixed evaluation sequences with needles spread evenly over depth bucket `bucket`."""
        rng = random.Random(f"recall-eval:{self.seed}:{bucket}")
        positions = self.key_range(bucket)
        return [self.make(rng, positions[(2 * i + 1) * len(positions) // (2 * n)]) for i in range(n)]


@dataclass(frozen=True)
class Corpus:
    """A token stream and what it was read from."""

    tokens: np.ndarray  # (N,) uint8 or uint16 token ids
    files: int  # documents read as files (1 for a single file)
    bytes: int  # bytes read from them
    what: str  # for messages: "text /path (12 files)"


class TokenWindows:
    """Random windows of `seq_len + 1` tokens from one long token array (bytes or uint16).

    With `eod` (packing on), each window also gets its document ids, and the labels that would
    predict across a boundary are IGNORE: the label of an EOD input is the next document's first
    token, which the model, seeing only the current document, cannot predict.
    """

    def __init__(self, corpus: Corpus, cfg: DataConfig, vocab_size: int, eod: int | None = None):
        tokens, what = corpus.tokens, corpus.what
        if len(tokens) < cfg.seq_len + 1:
            raise ConfigError(
                f"data.path: {what} holds {len(tokens)} tokens, fewer than data.seq_len + 1 = {cfg.seq_len + 1}"
            )
        # Checked once, over the whole file, while every rank builds its source: a bad id found
        # only when its batch is drawn would stop one data-parallel group and leave the others
        # waiting in a collective until the timeout.
        largest = int(tokens.max())
        if largest >= vocab_size:
            raise ConfigError(f"data.path: {what} holds token {largest} but model.vocab_size is {vocab_size}")
        if eod is not None and not _holds(tokens, eod):
            # Packing would silently be one endless document: almost surely the wrong eod_token.
            raise ConfigError(
                f"data.eod_token: {what} never holds the end-of-document token {eod}, so data.pack_documents "
                "would find no document boundary; set data.eod_token to the separator the data uses"
            )
        self.corpus, self.tokens, self.L, self.seed, self.eod = corpus, tokens, cfg.seq_len, cfg.seed, eod

    def __call__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.window(random.Random(f"window:{self.seed}:{index}").randrange(len(self.tokens) - self.L))

    def window(self, start: int) -> tuple[torch.Tensor, ...]:
        """The sample of tokens `start .. start + seq_len`: `(inputs, labels)`, or with `eod` also `doc_ids`."""
        window = torch.from_numpy(self.tokens[start : start + self.L + 1].astype(np.int64))
        inputs, labels = window[:-1], window[1:]
        if self.eod is None:
            return inputs, labels
        ends = inputs == self.eod  # (L,) an EOD input is the last token of its document
        doc_ids = torch.cumsum(ends, 0) - ends.long()  # documents ended strictly before each position
        return inputs, labels.masked_fill(ends, IGNORE), doc_ids

    def spread(self, n: int) -> list[int]:
        """`n` window starts spread evenly from the first token to the last window: a fixed set."""
        last = len(self.tokens) - self.L - 1
        return [i * last // max(1, n - 1) for i in range(n)]


def _holds(tokens: np.ndarray, value: int, chunk: int = 1 << 24) -> bool:
    """Whether `value` occurs in `tokens`, read in chunks: a memory-mapped corpus of billions of
    tokens must not become one boolean array, and a real corpus holds its first EOD early."""
    return any((tokens[i : i + chunk] == value).any() for i in range(0, len(tokens), chunk))


def data_root(cfg: DataConfig) -> Path:
    """`data.path`, with `@stdlib` resolved to the running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"]) if cfg.path == STDLIB else Path(cfg.path)


def document_files(root: Path, pattern: str, stdlib: bool = False) -> list[str]:
    """The documents of a directory: relative POSIX paths of the files `pattern` matches, sorted as
    strings, so the order depends only on the names (not on the file system's listing order).
    `stdlib`: leave out the third-party packages installed under the standard library."""
    rels = sorted(p.relative_to(root).as_posix() for p in root.glob(pattern) if p.is_file())
    return [r for r in rels if r.split("/")[0] not in NOT_STDLIB] if stdlib else rels


def is_heldout(rel: str, fraction: float) -> bool:
    """Whether the document at relative path `rel` is held out. A hash of the path alone decides,
    so a file lands on the same side on every machine whichever other files that machine has."""
    h = int.from_bytes(hashlib.blake2b(rel.encode(), digest_size=8).digest(), "big")
    return h < fraction * 2**64


def _text_tokens(root: Path, rels: list[str], eod: int | None = None) -> np.ndarray:
    """Bytes of the files `rels` under `root`, concatenated in that order.

    With `eod` (packing), each file is one document: each file that does not already end with
    `eod` gets it appended. An `eod` >= 256 (not a byte) makes the result uint16.
    """
    dtype = np.uint8 if eod is None or eod < 256 else np.uint16
    if eod is None:
        return np.frombuffer(b"".join((root / r).read_bytes() for r in rels), dtype=np.uint8)
    docs = []
    for r in rels:
        doc = np.frombuffer((root / r).read_bytes(), dtype=np.uint8).astype(dtype)
        docs.append(doc if len(doc) and doc[-1] == eod else np.append(doc, np.array(eod, dtype)))
    return np.concatenate(docs) if docs else np.zeros(0, dtype)


def _file_tokens(path: Path, eod: int | None = None) -> np.ndarray:
    """The bytes of one file, memory-mapped (uint16 when `eod` is not a byte)."""
    dtype = np.uint8 if eod is None or eod < 256 else np.uint16
    if not path.stat().st_size:  # np.memmap refuses an empty file; TokenWindows says it is too short
        return np.zeros(0, dtype)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    return data if dtype == np.uint8 else data.astype(dtype)


def _bin_tokens(path: Path) -> np.ndarray:
    """nanoGPT's format: a flat array of uint16 token ids."""
    if path.stat().st_size % 2:
        raise ConfigError(f"data.path: {path} has an odd number of bytes; not a uint16 token file")
    if not path.stat().st_size:
        return np.zeros(0, np.uint16)
    return np.memmap(path, dtype=np.uint16, mode="r")


def _split_tail(corpus: Corpus, fraction: float) -> tuple[Corpus, Corpus]:
    """A single file's corpus cut in two: the last `fraction` of its tokens held out."""
    n = len(corpus.tokens)
    cut = n - round(n * fraction)
    head_bytes = corpus.bytes * cut // max(1, n)
    return (
        Corpus(corpus.tokens[:cut], 1, head_bytes, corpus.what),
        Corpus(corpus.tokens[cut:], 1, corpus.bytes - head_bytes, f"the held-out last {fraction:g} of {corpus.what}"),
    )


def corpora(cfg: DataConfig) -> tuple[Corpus, Corpus | None]:
    """The training and the held-out corpus of a text or bin `data.path` (None: `data.heldout` = 0).

    A directory of text files is split by file (`is_heldout`); nanoGPT's directory by its files
    (train.bin, and val.bin held out); a single file by its last `data.heldout` of tokens.
    """
    root, f = data_root(cfg), cfg.heldout
    if not root.exists():
        raise ConfigError(f"data.path: {root} does not exist (data.kind = {cfg.kind!r})")
    eod = resolve_eod_token(cfg) if cfg.pack_documents else None
    try:
        if cfg.kind == "bin":
            path = root / "train.bin" if root.is_dir() else root
            if not path.is_file():
                raise ConfigError(f"data.path: directory {root} has no train.bin")
            train = Corpus(_bin_tokens(path), 1, path.stat().st_size, f"token file {path}")
            val = root / "val.bin"
            if not f:
                return train, None
            if root.is_dir() and val.is_file():
                return train, Corpus(_bin_tokens(val), 1, val.stat().st_size, f"token file {val}")
            return _split_tail(train, f)
        if root.is_file():
            whole = Corpus(_file_tokens(root, eod), 1, root.stat().st_size, f"text {root}")
            return _split_tail(whole, f) if f else (whole, None)
        rels = document_files(root, cfg.files, stdlib=cfg.path == STDLIB)
        if not rels:
            raise ConfigError(f"data.path: directory {root} holds no files" + (
                f" matching data.files = {cfg.files!r}" if cfg.files != "**/*" else ""))
        held = [r for r in rels if is_heldout(r, f)]
        kept = [r for r in rels if not is_heldout(r, f)]

        def corpus(part: list[str], what: str) -> Corpus:
            n_bytes = sum((root / r).stat().st_size for r in part)
            return Corpus(_text_tokens(root, part, eod), len(part), n_bytes, f"{what} {root} ({len(part)} files)")

        if not f:
            return corpus(kept, "text"), None
        if not held or not kept:
            raise ConfigError(
                f"data.heldout ({f:g}) holds out {len(held)} of the {len(rels)} files of {root}: both parts "
                "need at least one file; change data.heldout or add files"
            )
        return corpus(kept, "text"), corpus(held, "held-out text")
    except OSError as e:  # unreadable (permissions, a FIFO, an I/O error): name the path, not a traceback
        raise ConfigError(f"data.path: cannot read {e.filename or root}: {e.strerror or e}") from None


def build_sources(cfg: DataConfig, vocab_size: int) -> tuple:
    """`(source, warmup_source)`: the sample source of `cfg`, and the one of the sequence-length
    warm-up (the same data at `warmup_seq_len` tokens; None when the warm-up is off)."""
    source = build_source(cfg, vocab_size)
    if not cfg.warmup_seq_len:
        return source, None
    try:
        return source, build_source(warmup_data(cfg), vocab_size)
    except ConfigError as e:
        raise ConfigError(f"data.warmup_seq_len ({cfg.warmup_seq_len}): {e}") from None


def build_source(cfg: DataConfig, vocab_size: int):
    """The sample source named by `cfg.kind`; a callable `index -> (inputs (L,), labels (L,))`,
    or `(inputs, labels, doc_ids (L,))` with `cfg.pack_documents`."""
    if cfg.kind == "recall":
        if vocab_size < 256:
            raise ConfigError(f"model.vocab_size ({vocab_size}) must be >= 256 for byte-level recall")
        return RecallTask(cfg)
    if cfg.kind == "passkey":
        if vocab_size < 256:
            raise ConfigError(f"model.vocab_size ({vocab_size}) must be >= 256 for byte-level passkey")
        return PasskeyTask(cfg)
    if cfg.kind == "text" and vocab_size < 256:
        raise ConfigError(f"model.vocab_size ({vocab_size}) must be >= 256 for byte-level text")
    eod = resolve_eod_token(cfg) if cfg.pack_documents else None
    return TokenWindows(corpora(cfg)[0], cfg, vocab_size, eod)


def build_heldout(cfg: DataConfig, vocab_size: int) -> TokenWindows | None:
    """The held-out windows of a text or bin corpus (`data.heldout`), packed like training's; None
    without them. Its samples come from `TokenWindows.window` at fixed starts, never at random."""
    if cfg.kind not in ("text", "bin") or not cfg.heldout:
        return None
    eod = resolve_eod_token(cfg) if cfg.pack_documents else None
    return TokenWindows(corpora(cfg)[1], cfg, vocab_size, eod)


class DataLoader:
    """Micro-batches for one data-parallel rank, resumable exactly from `state_dict()`.

    Sample index of sequence i in micro-step m of step s: S0 + (((s − s0)·accum + m)·dp + dp_rank)·B + i,
    so dp ranks see disjoint samples and all cp ranks of one dp group see the same ones; step s
    draws the G = B·accum·dp samples that follow the previous step's. The origin (s0, S0) is
    (0, 0) unless the run resumed with another batch geometry. Steps before `warmup_steps` draw
    from `warmup_source` (shorter sequences), later ones from `source`.

    The data position is the global sample index (the first sample of the next step): a run
    resumed with another dp (another world size), grad_accum or batch_size continues from it, so it
    sees the samples an uninterrupted run would have seen next, and with the same global batch G
    (e.g. dp halved and grad_accum doubled) every step draws exactly the same set of samples.
    """

    def __init__(
        self, source, batch_size: int, grad_accum: int, dp_rank: int, dp_size: int,
        warmup_source=None, warmup_steps: int = 0,
    ):  # fmt: skip
        self.source, self.B, self.accum = source, batch_size, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.warmup_source, self.warmup_steps = warmup_source, warmup_steps if warmup_source else 0
        self.step = 0  # the next step to produce
        self.origin = (0, 0)  # (step, global sample index) from which this geometry counts

    def source_at(self, step: int):
        return self.warmup_source if step < self.warmup_steps else self.source

    def sample_at(self, step: int) -> int:
        """The global index of step `step`'s first sample."""
        s0, first = self.origin
        return first + (step - s0) * self.accum * self.dp_size * self.B

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, ...]:
        """Full (unsharded) `inputs, labels (B, L)` int64 of one micro-step, and `doc_ids (B, L)`
        when the source packs documents."""
        first = self.sample_at(step) + (micro * self.dp_size + self.dp_rank) * self.B
        source = self.source_at(step)
        samples = [source(first + i) for i in range(self.B)]
        return tuple(torch.stack(column) for column in zip(*samples, strict=True))

    def next(self) -> list[tuple[torch.Tensor, ...]]:
        """The `grad_accum` micro-batches of the next step."""
        micros = [self.batch(self.step, m) for m in range(self.accum)]
        self.step += 1
        return micros

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "sample": self.sample_at(self.step),
            "origin": list(self.origin),
            "batch_size": self.B,
            "grad_accum": self.accum,
            "dp_size": self.dp_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at `state`'s step and global sample index, whatever this loader's batch geometry."""
        geometry = ("batch_size", "grad_accum", "dp_size")
        if all(state[k] == getattr(self, a) for k, a in zip(geometry, ("B", "accum", "dp_size"))):
            self.origin = tuple(state.get("origin", (0, 0)))  # the same numbering: a bit-exact resume
        else:
            # Another geometry numbers steps' samples differently: count on from the saved position.
            saved = state["step"] * state["batch_size"] * state["grad_accum"] * state["dp_size"]
            self.origin = (state["step"], state.get("sample", saved))  # (checkpoints before "sample": no origin)
        self.step = state["step"]
