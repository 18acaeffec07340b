"""The training loop: build, (resume,) step, log, evaluate, checkpoint.

    result = train(load_config("configs/tiny_cpu.toml"))

Loss normalisation. The loss of a step is the mean over *every* labelled token of the step: all
micro-steps, all dp ranks, all cp shards. Each rank computes the sum over its own tokens and
scales it by world / (global token count); DDP (or FSDP2) then averages gradients over the world, so the
result is exactly the gradient of the global mean, whatever cp is. That is what makes a cp = 2
run equal a cp = 1 run on the same batch, even when (as in passkey) the labelled tokens all sit
on one rank.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ringflash.train.checkpoint import Checkpointer, complete_checkpoints
from ringflash.train.checkpoint_files import agree
from ringflash.train.config import Config, ConfigError, check_early_update, resolve_eod_token, to_dict
from ringflash.train.data import IGNORE, DataLoader, PasskeyTask, RecallTask, build_sources
from ringflash.train.evaluate import accuracy_by_owner, bucket_owners, evaluate_passkey, report
from ringflash.train.heldout import HeldOut
from ringflash.train.hf_model import build_model
from ringflash.train.memory import live_bytes, memory_line
from ringflash.train.metrics import (
    Logger,
    flops_per_token,
    matmul_params,
    peak_memory_gib,
    peak_tflops,
    tflops_per_device,
)
from ringflash.train.parallel import (
    ParallelContext,
    attention_mask,
    check_same_config,
    clip_grad_norm,
    distributed,
    no_sync,
    parallelize,
    parallelize_hf,
    shard_batch,
)
from ringflash.train.runs import Run, resolve_run
from ringflash.train.step_profile import StepProfile, gather_and_write, phase_range, ringflash_kernels


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm became NaN or infinite; the run stops before the update."""


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)  # step -> global mean loss
    passkey: list[float] | None = None  # final retrieval accuracy per depth bucket
    heldout: dict[int, float] = field(default_factory=dict)  # step -> held-out bits per byte (data.heldout)
    final_step: int = 0
    model: nn.Module | None = None  # the trained (unwrapped) model, for tests


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms; the tied embedding is a matrix)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.train.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    t = cfg.train
    fused = next(model.parameters()).is_cuda  # one kernel for all parameters on GPU
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=fused or None)


def fan_in_and_depth(model: nn.Module, cfg: Config) -> tuple[int, int]:
    """The largest fan-in of the model's linear layers and its number of layers."""
    fan_in = max(m.in_features for m in model.modules() if isinstance(m, nn.Linear))
    hf = getattr(model, "hf", None)  # train.hf_model.HFCausalLM's transformers model
    return fan_in, hf.config.num_hidden_layers if hf is not None else cfg.model.n_layers


def lr_lambda(cfg: Config):
    """Multiplier of the peak lr at step s: linear warm-up, then cosine down to min_lr_ratio."""
    t = cfg.train

    def f(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return f


def autocast_for(cfg: Config, device: torch.device) -> contextlib.AbstractContextManager:
    dtype = cfg.train.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def forward_backward(
    model: nn.Module,
    micros: list[tuple[torch.Tensor, ...]],
    pc: ParallelContext,
    layout: str,
    autocast: contextlib.AbstractContextManager,
    window: int | None = None,
    mask_fn=None,
) -> torch.Tensor:
    """Accumulate the gradient of the step's global-mean loss; return that loss (0-dim, every rank).

    `micros` are this dp rank's full `(B, L)` micro-batches, `(inputs, labels)` or, with packed
    documents, `(inputs, labels, doc_ids)`; each is sharded over cp here, after its attention mask
    (documents and/or `window`, `model.window`) is built from the global batch, by
    `mask_fn(doc_ids, seq_len)` if given (an HF model's per-layer windows: `HFCausalLM.masks`).
    """
    n_tokens = sum(int((micro[1] != IGNORE).sum()) for micro in micros)
    n_tokens = torch.tensor(n_tokens, dtype=torch.float32, device=pc.device)
    dist.all_reduce(n_tokens, group=pc.dp_group)  # every cp rank already counted the whole sequences
    scale = pc.dims.world_size / n_tokens.clamp(min=1)  # DDP and FSDP2 divide by the world size
    loss_sum = torch.zeros((), device=pc.device)
    for i, (inputs, labels, *doc_ids) in enumerate(micros):
        if mask_fn is not None:
            mask = mask_fn(doc_ids[0] if doc_ids else None, inputs.shape[1])
        else:
            mask = attention_mask(doc_ids[0] if doc_ids else None, inputs.shape[1], pc, layout, window)
        x, y, pos = shard_batch(inputs, labels, pc, layout)
        last = i == len(micros) - 1
        # Gradients are reduced once, after the last micro-step.
        with no_sync(model, not last):
            with phase_range("forward"):
                with autocast:
                    logits = model(x, pos, mask=mask)  # (B, L/cp, vocab)
                local = F.cross_entropy(
                    logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE, reduction="sum"
                )
            with phase_range("backward"):
                (local * scale).backward()
        loss_sum += local.detach()
    dist.all_reduce(loss_sum)  # each labelled token lives on exactly one rank
    return loss_sum / n_tokens.clamp(min=1)


def _out_of_time(t_start: float, max_minutes: float, device: torch.device) -> bool:
    """Rank 0's clock decides, so that every rank stops after the same step."""
    over = torch.tensor(float(time.perf_counter() - t_start > 60 * max_minutes), device=device)
    dist.broadcast(over, src=0)
    return bool(over.item())


def train(cfg: Config) -> TrainResult:
    # The loop makes its Logger only once every check has passed (a rejected run must not leave an
    # empty runs/<dir>/tb/<stamp>/ behind) and registers its close in `on_exit`.
    with distributed(cfg.parallel, cfg.train.device, run=cfg) as pc, contextlib.ExitStack() as on_exit:
        return _loop(cfg, pc, on_exit)


@dataclass
class _Parts:
    """What a launch trains, built identically on every rank (DDP also broadcasts rank 0's weights)."""

    source: object  # the training task or text source
    loader: DataLoader
    passkey: PasskeyTask | RecallTask | None  # the task evaluated by depth bucket, if any
    raw: nn.Module  # the unwrapped model
    model: nn.Module  # the DDP / FSDP2 wrapper that steps
    mask_fn: Callable | None  # an HF model's per-layer masks; None: `attention_mask`
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    autocast: contextlib.AbstractContextManager


def _build(cfg: Config, pc: ParallelContext) -> _Parts:
    t = cfg.train
    try:  # the data's files may be missing on one node only: every rank hears which
        source, warmup_source = build_sources(cfg.data, cfg.model.vocab_size)
        error = None
    except ConfigError as e:
        error = str(e)
    agree(error, ConfigError)
    loader = DataLoader(
        source, cfg.data.batch_size, t.grad_accum, pc.dp_rank, pc.dims.dp, warmup_source, cfg.data.warmup_seq_steps
    )
    passkey = source if isinstance(source, (PasskeyTask, RecallTask)) and cfg.data.eval_samples > 0 else None
    torch.manual_seed(t.seed)  # after the data: the same initial weights whatever the task drew
    raw = build_model(cfg).to(pc.device)
    hf = cfg.model.kind == "hf"
    model = (parallelize_hf if hf else parallelize)(raw, pc, cfg)
    optimizer = build_optimizer(raw, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    mask_fn = raw.masks if hf else None
    return _Parts(source, loader, passkey, raw, model, mask_fn, optimizer, scheduler, autocast_for(cfg, pc.device))


def _resume(cfg: Config, run: Run, ckpt: Checkpointer, parts: _Parts) -> tuple[int, Path | None, list[str]]:
    """The step this launch starts at, the checkpoint it resumed from (None: fresh) and what to say about it."""
    path = ckpt.resolve(run.resume)
    if path is not None:
        state, warning = ckpt.load(path, parts.model, parts.optimizer)
        parts.scheduler.load_state_dict(state["scheduler"])
        parts.loader.load_state_dict(state["data"])
        step = state["step"]
        return step, path, [f"resumed from {path} at step {step}"] + ([f"warning: {warning}"] if warning else [])
    if run.resume:
        return 0, None, [f"no complete checkpoint in {ckpt.dir} yet: starting this run fresh"]
    if cfg.checkpoint.enabled and complete_checkpoints(ckpt.dir):
        # Starting over here would interleave two runs' checkpoints; make the user choose.
        raise ConfigError(
            f"checkpoint.dir {ckpt.dir} already holds checkpoints "
            f"({complete_checkpoints(ckpt.dir)[-1].name}): pass --resume to continue "
            f"that run, or give another --checkpoint.dir / --logging.run_id (auto: a new directory per run)"
        )
    return 0, None, []


def _loop(cfg: Config, pc: ParallelContext, on_exit: contextlib.ExitStack) -> TrainResult:
    t = cfg.train
    # Before anything that can fail on one rank only: a rank with another config is named here.
    check_same_config(cfg)
    # The learning-rate bound needs only the model's shape: built on the meta device, so that with
    # train.strict_lr every rank refuses before any data, weights or checkpoints are touched.
    with torch.device("meta"):
        lr_warning = check_early_update(t, *fan_in_and_depth(build_model(cfg), cfg))
    parts = _build(cfg, pc)
    run = resolve_run(cfg, pc.rank)
    on_exit.callback(run.remove_if_unused, pc.is_main)  # after log.close: a run that wrote nothing
    ckpt = Checkpointer(
        run.checkpoints, cfg.checkpoint.keep, pc.rank, pc.device, trust_unverified=cfg.checkpoint.trust_unverified
    )
    ckpt.clean_partial()
    step, path, resume_notes = _resume(cfg, run, ckpt, parts)

    stop = t.stop_at or t.steps
    # A run resumed at its end has nothing to log: no TensorBoard directory for it either.
    log = Logger(str(run.dir), pc.is_main, cfg.logging.tensorboard and step < stop, cfg.logging.progress_bar)
    on_exit.callback(log.close)
    for note in resume_notes:
        log.print(note)
    if lr_warning:  # at every start, resumed too: every launch's log shows the setting it trains under
        log.print(f"warning: {lr_warning}")
    if step >= stop:
        # Resumed where it stops: its evaluation and save at that step were done when it got there.
        # Empty losses tell the caller that nothing ran.
        return TrainResult(final_step=step, model=parts.raw)

    session = _Session(cfg, pc, parts, ckpt, log, last_saved=step if path is not None else -1, run_dir=run.dir)
    session.print_setup()
    heldout = HeldOut.build(cfg, pc, parts.raw, parts.source, parts.autocast, parts.mask_fn, log)
    result = TrainResult(final_step=step)
    if heldout is not None and step == 0:
        result.heldout[0] = heldout(0)  # the curve's start: the untrained model
    t_start = time.perf_counter()
    step = session.run_steps(step, stop, heldout, result, t_start)
    if parts.passkey is not None:
        result.passkey = session.evaluate(step)
    if cfg.checkpoint.enabled and step != session.last_saved:
        session.save(step)
    result.final_step, result.model = step, parts.raw
    session.print_summary(result, t_start)
    return result


@dataclass
class _StepStats:
    """One step's loss, gradient norm and learning rate, its wall time, tokens and model FLOPs."""

    loss: float
    grad_norm: float
    lr: float
    seconds: float
    tokens: int
    flops: float


@dataclass
class _Throughput:
    """Time, tokens and FLOPs since the last printed step line (evaluations excluded)."""

    seconds: float = 0.0
    tokens: int = 0
    flops: float = 0.0

    def add(self, seconds: float, tokens: int, flops: float) -> None:
        self.seconds += seconds
        self.tokens += tokens
        self.flops += flops

    def reset(self) -> None:
        self.seconds, self.tokens, self.flops = 0.0, 0, 0.0


class _Session:
    """One launch's training once every check has passed: the steps, their log lines, evaluations and saves."""

    def __init__(self, cfg: Config, pc: ParallelContext, parts: _Parts, ckpt: Checkpointer, log: Logger,
                 last_saved: int, run_dir: Path):
        self.cfg, self.pc, self.parts, self.ckpt, self.log = cfg, pc, parts, ckpt, log
        self.run_dir = run_dir
        self.last_saved = last_saved
        self.name = cfg.data.kind  # passkey or recall: the printed name and the TensorBoard tag prefix
        passkey = parts.passkey
        self.owners = (
            bucket_owners(passkey, pc.dims.cp, cfg.parallel.layout, pc.dims.cp_heads) if passkey is not None else []
        )
        # What a step costs, for throughput and MFU (at the step's sequence length).
        self.n_matmul = matmul_params(parts.raw)
        self.shape = getattr(parts.raw, "flops_config", cfg.model)  # layers, width and attn_spec: attention FLOPs
        self.peak = peak_tflops(pc.device, cfg.logging.peak_tflops)

    def save(self, at: int) -> None:
        self.last_saved = at
        train_state = {
            "step": at,
            "scheduler": self.parts.scheduler.state_dict(),
            "data": self.parts.loader.state_dict(),
            "config": to_dict(self.cfg),
            "parallel_dims": asdict(self.pc.dims),  # what ran, where the config says auto
        }
        self.log.print(f"checkpoint: {self.ckpt.save(at, self.parts.model, self.parts.optimizer, train_state)}")

    def evaluate(self, at: int) -> list[float]:
        cfg, name, log = self.cfg, self.name, self.log
        acc = evaluate_passkey(
            self.parts.raw,
            self.parts.passkey,
            self.pc,
            cfg.parallel.layout,
            cfg.data.eval_samples,
            cfg.data.batch_size,
            self.parts.autocast,
            window=cfg.model.attn_spec.window,
        )
        by_rank = accuracy_by_owner(acc, self.owners)
        log.scalars(at, {f"{name}/acc_bucket{i}": a for i, a in enumerate(acc)})
        log.scalars(at, {f"{name}/acc_mean": sum(acc) / len(acc), f"{name}/acc_min": min(acc)})
        log.scalars(at, {f"{name}/acc_key_on_rank{r}": a for r, a in by_rank.items()})
        log.print(
            f"step {at:6d} | {name} accuracy by depth bucket: "
            + " ".join(f"{a:.2f}" for a in acc)
            + f" | min {min(acc):.2f} | key on "
            + ", ".join(f"rank {r}: {a:.2f}" for r, a in by_rank.items())
        )
        return acc

    def step_cost(self, at: int, micros=None) -> tuple[int, float]:
        """Tokens and model FLOPs of step `at`, all ranks together. With packed documents the
        attention work depends on the batch: it is counted on this dp rank's micro-batches, times dp."""
        cfg, dims = self.cfg, self.pc.dims
        L = cfg.data.warmup_seq_len if at < self.parts.loader.warmup_steps else cfg.data.seq_len
        tokens = dims.dp * cfg.train.grad_accum * cfg.data.batch_size * L
        if micros is None or not cfg.data.pack_documents:
            return tokens, flops_per_token(self.shape, self.n_matmul, L) * tokens
        local = sum(flops_per_token(self.shape, self.n_matmul, L, doc_ids) * doc_ids.numel() for *_, doc_ids in micros)
        return tokens, dims.dp * local

    def print_setup(self) -> None:
        cfg, pc, log, dev = self.cfg, self.pc, self.log, self.pc.device
        tokens_per_step, _ = self.step_cost(self.parts.loader.warmup_steps)
        log.print(
            f"model {self.parts.raw.num_params() / 1e6:.2f}M params | dp {pc.dims.dp} × cp {pc.dims.cp} on {dev.type} "
            f"({dist.get_backend()}) | {tokens_per_step} tokens/step, {cfg.data.seq_len // pc.dims.cp} per rank per seq"
        )
        if pc.dims.chosen:
            log.print(pc.dims.chosen)
        if cfg.data.pack_documents or cfg.model.window:
            docs = f"packed documents ending at token {resolve_eod_token(cfg.data)}" if cfg.data.pack_documents else ""
            window = f"sliding window of {cfg.model.window} tokens" if cfg.model.window else ""
            log.print("attention: " + ", ".join(filter(None, (docs, window))))
        warmup_steps = self.parts.loader.warmup_steps
        if warmup_steps:
            log.print(f"sequence-length warm-up: {cfg.data.warmup_seq_len} tokens/seq for {warmup_steps} steps")
        if self.parts.passkey is not None:
            log.print(f"{self.name} depth buckets held by cp ranks: " + " ".join(map(str, self.owners)))

    def update(self, step: int, micros, first: bool) -> tuple[float, float, float]:
        """One optimizer step on `micros`: the step's loss, gradient norm and learning rate."""
        cfg, pc, parts = self.cfg, self.pc, self.parts
        loss = forward_backward(
            parts.model, micros, pc, cfg.parallel.layout, parts.autocast, cfg.model.attn_spec.window, parts.mask_fn
        )
        clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        grad_norm = clip_grad_norm(parts.raw.parameters(), clip)  # the global norm, over FSDP's shards too
        loss_f, norm_f = loss.item(), grad_norm.item()  # identical on every rank (all-reduced)
        if not (math.isfinite(loss_f) and math.isfinite(norm_f)):
            # Raised before the update and before any save: the last checkpoint stays the last good one.
            latest = complete_checkpoints(self.ckpt.dir)
            raise NonFiniteLossError(
                f"non-finite {'loss' if not math.isfinite(loss_f) else 'gradient norm'} at step "
                f"{step + 1} (loss {loss_f}, grad norm {norm_f}); stopping without updating or saving. "
                f"Latest complete checkpoint: {latest[-1] if latest else 'none'}. "
                f"Try a lower --train.lr or --train.grad_clip."
            )
        lr = parts.scheduler.get_last_lr()[0]
        with phase_range("optimizer"):
            parts.optimizer.step()
            parts.scheduler.step()
        if first:  # the first step of this launch: gradients and AdamW states are live
            fsdp_world = pc.dims.world_size if cfg.parallel.fsdp else None
            self.log.print(memory_line(live_bytes(parts.raw, parts.optimizer), fsdp_world))
        with phase_range("optimizer"):
            parts.optimizer.zero_grad(set_to_none=True)
        return loss_f, norm_f, lr

    def log_step(self, step: int, stop: int, s: _StepStats, window: _Throughput) -> None:
        """TensorBoard scalars every step; a printed line every log_every steps and at the last."""
        dev, world = self.pc.device, self.pc.dims.world_size
        loss_f, norm_f, lr = s.loss, s.grad_norm, s.lr
        tflops = tflops_per_device(s.flops, s.seconds, world)
        metrics = {
            "loss": loss_f,
            "lr": lr,
            "grad_norm": norm_f,
            "tokens_per_s": s.tokens / s.seconds,
            "tflops_per_device": tflops,
            "memory/peak_gib": peak_memory_gib(dev),
        }
        if self.peak > 0:
            metrics["mfu"] = tflops / self.peak
        self.log.scalars(step, metrics)
        self.log.advance(loss_f)
        window.add(s.seconds, s.tokens, s.flops)
        if step % self.cfg.logging.log_every == 0 or step == stop:
            avg_tflops = tflops_per_device(window.flops, window.seconds, world)
            mfu = f" | MFU {100 * avg_tflops / self.peak:.1f}%" if self.peak > 0 else ""
            self.log.print(
                f"step {step:6d} | loss {loss_f:.4f} | lr {lr:.2e} | grad norm {norm_f:.3f} | "
                f"{window.tokens / window.seconds:,.0f} tok/s | {avg_tflops:.2f} TFLOP/s{mfu} | "
                f"peak mem {metrics['memory/peak_gib']:.2f} GiB"
            )
            window.reset()

    def report_profile(self, step: int, prof: StepProfile, flops: float) -> None:
        """Every rank's breakdown of the profiled step; rank 0 prints its own and writes them all."""
        mine = prof.breakdown(ringflash_kernels(), flops, self.pc.dims.world_size, self.peak)
        for line in gather_and_write(mine, step, self.run_dir, self.pc.is_main):
            self.log.print(line)

    def run_steps(self, step: int, stop: int, heldout: HeldOut | None, result: TrainResult, t_start: float) -> int:
        """Step from `step` to `stop` (or until train.max_minutes); return the step reached."""
        cfg, t = self.cfg, self.cfg.train
        self.log.start_progress(step, t.steps)
        window = _Throughput()
        while step < stop:
            t0 = time.perf_counter()
            micros = self.parts.loader.next()
            tokens, flops = self.step_cost(step, micros)
            profiling = step + 1 == cfg.logging.profile_step
            with StepProfile(self.parts.raw, self.pc.device) if profiling else contextlib.nullcontext() as prof:
                loss_f, norm_f, lr = self.update(step, micros, first=step == result.final_step)
            step += 1
            stats = _StepStats(loss_f, norm_f, lr, time.perf_counter() - t0, tokens, flops)
            if profiling:  # after the step's clock: reading the profile back takes seconds on a large model
                self.report_profile(step, prof, flops)
            result.losses[step] = loss_f
            self.log_step(step, stop, stats, window)
            logged = step % cfg.logging.log_every == 0
            if t.max_minutes and logged and _out_of_time(t_start, t.max_minutes, self.pc.device):
                self.log.print(f"step {step:6d} | train.max_minutes = {t.max_minutes} reached: stopping early")
                stop = step
            if self.parts.passkey is not None and t.eval_every and step % t.eval_every == 0 and step != stop:
                self.evaluate(step)
            if heldout is not None and (step == stop or (t.eval_every and step % t.eval_every == 0)):
                result.heldout[step] = heldout(step)
            if cfg.checkpoint.enabled and cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
                self.save(step)
        return step

    def print_summary(self, result: TrainResult, t_start: float) -> None:
        cfg, pc, log, step = self.cfg, self.pc, self.log, result.final_step
        losses = list(result.losses.values())
        minutes, seconds = divmod(round(time.perf_counter() - t_start), 60)
        resumed = f" (resumed at step {step - len(losses)})" if len(losses) < step else ""
        log.print(
            f"summary: trained {len(losses)} steps{resumed} in {minutes}m{seconds:02d}s on {pc.dims.world_size} "
            f"{pc.device.type} processes (cp = {pc.dims.cp}, dp = {pc.dims.dp}); "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        )
        if result.passkey is not None:
            for line in report(self.name, result.passkey, self.parts.passkey, pc.dims.cp, cfg.parallel.layout,
                               cfg.data.eval_samples, pc.dims.cp_heads):
                log.print(line)
        if log.writer is not None:
            logdir = log.writer.get_logdir()
            log.print(f"TensorBoard logs: {logdir} (every run: tensorboard --logdir {cfg.logging.dir})")
        if cfg.checkpoint.enabled:
            log.print(f"checkpoint of step {step}: {self.ckpt.dir / f'step_{step:08d}'} (continue with --resume)")
