"""One attention call's own inputs and the checks every scheme (ring, all-gather) starts with:
flash_attn's arguments (`FlashArgs`) and ringflash's options (`CallOptions`), q/k/v in autocast's
dtype, q/k/v against the layout and world size, and the kernels that will run.
The checks raise TypeError/ValueError naming the argument; the cross-rank check (ringflash/agree.py)
then makes every rank raise with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from ringflash import kernels
from ringflash.kernels.checks import check_qkv, resolve_scale
from ringflash.layout import check_layout, check_scheme, check_splittable
from ringflash.transport import resolve_transport

__all__ = ["CallOptions", "FlashArgs", "autocast_inputs", "check_local", "flash_options", "world_size"]


class FlashArgs(NamedTuple):
    """flash_attn's own arguments of one call, in its positional order (`flash_options(*args, causal)`
    checks them and makes the call's `AttnSpec`)."""

    dropout_p: float = 0.0
    window_size: tuple[int, int] = (-1, -1)
    alibi_slopes: torch.Tensor | None = None
    deterministic: bool = False
    return_attn_probs: bool = False


@dataclass(frozen=True)
class CallOptions:
    """ringflash's own options of one attention call, beside flash_attn's arguments (`FlashArgs`):
    made once where a call enters (`ring_flash_attn_func`; the module and ringflash.hf's
    `RingContext` at construction; the varlen drop-ins) and handed to the scheme that runs it (the
    ring's `api._attend`, the all-gather's `allgather_ops.attend`, either inside the hybrid).
    `check()` is their one check, run inside each scheme's checks so that a refusal reaches every
    rank."""

    scheme: str = "ring"
    layout: str = "zigzag"
    backend: str | None = None
    transport: str | None = None
    heads_k_stride: int = 1
    softcap: float = 0.0
    check_ranks: bool = True

    def check(self) -> None:
        """Raises TypeError/ValueError naming the option; an option the scheme cannot honour is
        refused, never ignored: `heads_k_stride` (K/V heads per gather) is the all-gather's, which
        the ring has no use for; `transport` (how blocks travel between ring neighbours) is the
        ring's, and the all-gather moves K/V by the group's own collectives. The layout's and the
        backend's checks are `check_local`'s, which needs the inputs."""
        check_scheme(self.scheme)
        s = self.heads_k_stride
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"heads_k_stride must be a positive int (K/V heads per gather), got {s!r}")
        if self.transport is not None:
            resolve_transport(self.transport)  # an unknown name: the ring's message
        if self.scheme == "ring" and self.heads_k_stride != 1:
            raise ValueError(
                f"heads_k_stride={self.heads_k_stride}: scheme='ring' passes whole K/V blocks and cannot use it; it "
                "sets scheme='allgather''s K/V heads per gather (leave it at 1 for the ring)"
            )
        if self.scheme == "allgather" and self.transport is not None:
            raise ValueError(
                f"transport={self.transport!r}: scheme='allgather' gathers K/V with the group's collectives and "
                "cannot use it; it sets how scheme='ring' passes blocks between neighbours (leave it None for the "
                "all-gather)"
            )
        kernels.check_softcap(self.softcap)


def autocast_inputs(q, k, v) -> tuple:
    """q, k and v in autocast's dtype when autocast is on for their device, as SDPA runs them (and
    flash_attn's transformers path casts them): under autocast a Llama's RoPE leaves q and k in
    float32 while v leaves its Linear in bf16. Outside autocast they are left as given, and mixed
    dtypes are the caller's error (`check_qkv` names them)."""
    if not isinstance(q, torch.Tensor) or not torch.is_autocast_enabled(q.device.type):
        return q, k, v
    dtype = torch.get_autocast_dtype(q.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v))


def check_local(q, k, v, causal, softmax_scale, layout, backend, world, deterministic=False,
                ) -> tuple[float, kernels.Backend]:
    """This rank's own checks; raises TypeError/ValueError naming the argument. Returns the scale
    and the kernel backend that will run (resolved here, once per call; `deterministic`: `auto`
    picks kernels with bit-reproducible gradients)."""
    check_qkv(q, k, v)
    if k.shape[1] != q.shape[1]:
        raise ValueError(
            f"k.shape[1] (local seqlen) must equal q.shape[1] = {q.shape[1]}, got {k.shape[1]}: "
            "ring attention shards queries and keys alike"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_layout(layout)
    try:
        check_splittable(q.shape[1] * world, world, layout)
    except ValueError as e:
        raise ValueError(f"q.shape[1] = {q.shape[1]} local tokens on each of {world} ranks: {e}") from None
    kern = kernels.get_backend(backend, q.device, deterministic=deterministic)
    return resolve_scale(softmax_scale, q.shape[-1]), kern


def world_size(group) -> int:
    # Only what Dynamo can fold into a constant: RingComm's own checks of the group run in the op.
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def flash_options(dropout_p, window_size, alibi_slopes, deterministic, return_attn_probs, causal, window=None):
    """flash_attn's arguments checked, and the call's mask as the kernels' `AttnSpec` (causal and
    the window of `window_size`): where a window enters, converted and validated once. What
    ringflash cannot do is refused by the argument's name, never ignored; `window`, the old name of
    `window_size`, by a TypeError naming its replacement."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        # A bool here is usually a pre-0.x call, causal in 4th place: the order is flash_attn's now.
        raise TypeError(
            f"dropout_p must be a number, got {type(dropout_p).__name__} (the 4th positional argument is "
            "dropout_p, as in flash_attn: pass causal= by keyword)"
        )
    if dropout_p != 0:
        raise ValueError(f"dropout_p={dropout_p}: ringflash has no attention dropout (use 0.0)")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ringflash has no ALiBi (use None)")
    for name, flag in (("deterministic", deterministic), ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    kernels.refuse_window(window)
    return kernels.AttnSpec.from_window_size(window_size, causal=causal)
