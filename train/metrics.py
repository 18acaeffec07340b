"""What the loop reports: model FLOPs, MFU, memory, and the rank-0 logger (TensorBoard + tqdm).

FLOPs are *model* FLOPs (PaLM's convention, what MFU is defined on): 6 per parameter per token
for the matmuls (2 forward, 4 backward) plus attention's QKᵀ and PV, which for causal attention
over a context of L tokens cost 6·L·dim per token per layer (12·L·dim, halved by the mask).
Recomputation under activation checkpointing is not counted.
"""

from __future__ import annotations

import datetime
import resource
import sys
from pathlib import Path

import torch
import torch.nn as nn

from ringflash.kernels import check_window

# Dense bf16 peak TFLOP/s by GPU name fragment (no sparsity), most specific first.
_PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("4090", 165.0),
)


def flops_per_token(model_cfg, n_matmul_params: int, seq_len: int, doc_ids: torch.Tensor | None = None) -> float:
    """Training FLOPs per token: 6·(matmul params) + 12·n_layers·dim·(keys a query sees on average).

    `model_cfg` gives `n_layers`, `dim` and `attn_spec` (a `ModelConfig`, or an HF model's
    `flops_config`). The keys come from `attended_keys`: causal attention, the spec's sliding
    window, and, with `doc_ids`, packed documents each attending only to itself, so MFU counts only
    the work the masks leave.
    """
    keys = attended_keys(seq_len, model_cfg.attn_spec.window, doc_ids)
    return 6.0 * n_matmul_params + 12.0 * model_cfg.n_layers * keys * model_cfg.dim


def attended_keys(
    seq_len: int, window: int | tuple[int, int] | None = None, doc_ids: torch.Tensor | None = None
) -> float:
    """Keys a query sees on average over sequences of `seq_len` tokens.

    A causal document of n tokens counts n²/2 (query, key) pairs, FlashAttention's convention; with
    a window of w < n keys (None: no window), the exact n·w − w(w − 1)/2. `doc_ids (B, seq_len)`:
    packed documents (non-decreasing ids along each row), each counted on its own; None: one
    document per sequence.
    """
    window = check_window(window, causal=True)  # 0 is not "off": that is None
    window = None if window is None else window[0] + 1  # the pair (w - 1, 0) as w keys
    if doc_ids is None:
        lengths = torch.tensor([float(seq_len)], dtype=torch.float64)
        n_rows = 1
    else:
        rows = doc_ids.detach().cpu().reshape(-1, doc_ids.shape[-1])
        lengths = torch.cat([torch.unique_consecutive(r, return_counts=True)[1] for r in rows]).double()
        n_rows = rows.shape[0]
    pairs = lengths * lengths / 2
    if window is not None:
        pairs = torch.where(lengths > window, lengths * window - window * (window - 1) / 2, pairs)
    return float(pairs.sum()) / (n_rows * seq_len)


def tflops_per_device(flops: float, seconds: float, world: int) -> float:
    """Model TFLOP/s of one device: `flops` done by `world` devices together in `seconds`."""
    return flops / seconds / world / 1e12


def matmul_params(model: nn.Module) -> int:
    """Parameters used in matmuls: every nn.Linear weight (the embedding lookup is free)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def peak_tflops(device: torch.device, configured: float) -> float:
    """Peak dense bf16 TFLOP/s of one device; 0 when unknown (then no MFU is reported)."""
    if configured > 0 or device.type != "cuda":
        return configured
    name = torch.cuda.get_device_name(device)
    return next((peak for frag, peak in _PEAK_TFLOPS if frag in name), 0.0)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory on CUDA; peak resident memory of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 2**20


class Logger:
    """Rank-0 output: TensorBoard scalars, a tqdm bar with ETA, a summary line every N steps.

    The bar is drawn only when `stream` (default stderr) is a terminal; in a log file it would be
    carriage-return fragments that the summary lines get glued to. On other ranks every method is
    a no-op, so the loop calls it unconditionally.
    """

    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool, progress_bar: bool, stream=None):
        self.enabled, self.use_bar, self.writer, self.bar = enabled, progress_bar, None, None
        self.stream = stream
        if not enabled:
            return
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # One sub-directory per launch, so a resumed or repeated run shows as its own curve.
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            self.writer = SummaryWriter(str(Path(run_dir) / "tb" / stamp), flush_secs=20)

    def start_progress(self, first_step: int, total_steps: int) -> None:
        if self.enabled and self.use_bar:
            from tqdm import tqdm

            # The ETA counts from the first step of this launch, so a resumed run's is right too.
            # disable=None: tqdm draws only on a terminal.
            bar = tqdm(
                total=total_steps,
                initial=first_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=self.stream or sys.stderr,
                disable=None,
            )
            self.bar = None if bar.disable else bar

    def print(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)

    def advance(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


def plot_curves(run_dir: str, out_png: str, tags: tuple[str, ...] = ("loss", "passkey/acc_min")) -> None:
    """Plot TensorBoard scalars of every launch under `<run_dir>/tb` into one PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fig, axes = plt.subplots(1, len(tags), figsize=(5 * len(tags), 3.5), squeeze=False)
    for launch in sorted((Path(run_dir) / "tb").iterdir()):
        events = EventAccumulator(str(launch), size_guidance={"scalars": 0})
        events.Reload()
        for ax, tag in zip(axes[0], tags, strict=True):
            if tag in events.Tags()["scalars"]:
                points = events.Scalars(tag)
                ax.plot([p.step for p in points], [p.value for p in points], marker="." if len(points) < 50 else None)
    for ax, tag in zip(axes[0], tags, strict=True):
        ax.set_title(tag)
        if tag.startswith("passkey/acc"):
            ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


if __name__ == "__main__":
    # python -m train.metrics RUN_DIR OUT.png [TAG ...]
    plot_curves(sys.argv[1], sys.argv[2], tuple(sys.argv[3:]) or ("loss", "passkey/acc_min"))
