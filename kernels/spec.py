"""`AttnSpec`: which keys each query of one kernel call sees, as one immutable value.

    AttnSpec()                             # full: every query sees every key
    AttnSpec(causal=True)                  # causal diagonal block: query i sees keys j <= i
    AttnSpec(causal=True, window=w)        # causal sliding window: i - w < j <= i (w keys, the diagonal counted)
    AttnSpec(window=(left, right))         # two-sided window: i - left <= j <= i + right (-1: no limit)
    AttnSpec.documents(cu_seqlens, total)  # packed documents (+ causal=, window=)
    AttnSpec(intervals=vis)                # any per-row key intervals (kernels/masks.py `Visibility`)
    AttnSpec(causal=True, softcap=30.0)    # + logit softcapping: scores s -> c·tanh(s/c) before the mask

The public functions take flash_attn's `causal=` / `window=` and build the spec; everything
below them (the backends, the ring's steps) takes the spec. It is validated once, here, when it
is made. A window or documents become intervals (`Visibility`) only where a kernel needs them:
`spec.intervals_for(q, k)`. flash_attn's `window_size=(left, 0)` is `window = left + 1`.

`softcap` is not a mask but a score transform; it rides on the spec because the spec is the one
value every backend and every ring step already receives, so it is defined here once and read
by each kernel from here (`softcap_math` gives the reference's formula).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

from ringflash.kernels.masks import Visibility, check_visibility, check_window, dense_visibility, varlen_visibility

__all__ = ["CAUSAL", "FULL", "AttnSpec", "check_softcap", "check_window", "softcap_math"]


@dataclass(frozen=True, eq=False)
class AttnSpec:
    """What each query of one kernel call sees (module docstring).

    Attributes:
        causal: query i sees key j only if j <= i (needs Nq == Nk: a diagonal block).
        window: with causal, only the last `window` keys up to the diagonal; without, a pair
            `(left, right)`: keys i − left ... i + right (kernels/masks.py); None: no window.
        intervals: per-row key intervals (`Visibility`), replacing causal and window; Nq, Nk free.
        softcap: c > 0 caps the scaled scores to c·tanh(s/c) (Gemma 2's logit softcapping), before
            the mask; 0.0: none (flash_attn's `softcap=0.0`).
    """

    causal: bool = False
    window: int | tuple[int, int] | None = None
    intervals: Visibility | None = None
    softcap: float = 0.0

    def __post_init__(self):
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {type(self.causal).__name__}")
        check_softcap(self.softcap)
        check_window(self.window, self.causal)
        if self.intervals is not None:
            if self.causal or self.window is not None:
                raise ValueError(
                    "intervals already say which keys each query sees: give them without causal or window "
                    "(build them with kernels.visibility(..., causal=True, window=...))"
                )
            if not isinstance(self.intervals, tuple) or len(self.intervals) != 4:
                raise TypeError(
                    f"intervals must be a Visibility (kv_lo, kv_hi, q_lo, q_hi), got {type(self.intervals).__name__}"
                )

    @classmethod
    def documents(cls, cu_seqlens: torch.Tensor, total: int, *, causal: bool = False,
                  window: int | None = None) -> AttnSpec:
        """Packed documents (`cu_seqlens (n_docs + 1,)` over `total` tokens, batch 1): each token
        sees only its own document, causally and within `window` if asked."""
        return cls(intervals=varlen_visibility(cu_seqlens, total, causal=causal, window=window))

    @property
    def kind(self) -> Literal["full", "causal", "window", "intervals"]:
        if self.intervals is not None:
            return "intervals"
        if self.window is not None:
            return "window"
        return "causal" if self.causal else "full"

    @property
    def dense(self) -> bool:
        """Full or plain causal without softcap: what every backend runs (cuDNN runs nothing else)."""
        return self.kind in ("full", "causal") and not self.softcap

    def with_softcap(self, softcap: float) -> AttnSpec:
        """This mask with `softcap` (the ring gives each step's spec the call's softcap)."""
        return self if softcap == self.softcap else replace(self, softcap=softcap)

    def intervals_for(self, q: torch.Tensor, k: torch.Tensor) -> Visibility | None:
        """The `Visibility` a kernel runs with for q `(B, Nq, ...)` over k `(B, Nk, ...)`, checked;
        None for the dense masks (full, causal), which the kernels compute without intervals."""
        B, Nq = q.shape[:2]
        Nk = k.shape[1]
        if self.causal and Nq != Nk:
            raise ValueError(
                f"causal=True needs as many queries as keys (a diagonal block), got q.shape[1] = {Nq} "
                f"and k.shape[1] = {Nk}"
            )
        if self.intervals is not None:
            check_visibility(self.intervals, B, Nq, Nk, q.device)
            return self.intervals
        if self.window is None:
            return None
        if Nq != Nk:
            raise ValueError(f"a window needs as many queries as keys (one sequence), got {Nq} and {Nk}")
        return dense_visibility(Nq, window=self.window, device=q.device)

    def __eq__(self, other) -> bool:
        # By value for the dense masks and windows; intervals (tensors) by identity.
        if not isinstance(other, AttnSpec):
            return NotImplemented
        mine, theirs = (self.causal, self.window, self.softcap), (other.causal, other.window, other.softcap)
        return mine == theirs and self.intervals is other.intervals

    def __hash__(self) -> int:
        vis = id(self.intervals) if self.intervals is not None else None
        return hash((self.causal, self.window, self.softcap, vis))

    def __repr__(self) -> str:
        cap = f", softcap={self.softcap}" if self.softcap else ""
        extra = f", window={self.window}" if self.window is not None else ""
        if self.intervals is not None:
            return f"AttnSpec(intervals=<{tuple(self.intervals.kv_lo.shape)}>{cap})"
        return f"AttnSpec(causal={self.causal}{extra}{cap})"


def check_softcap(softcap) -> None:
    """softcap must be a finite float >= 0 (0: none); raises naming `softcap`."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0.0: none), got {type(softcap).__name__}")
    if not (softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be >= 0 and finite (0.0: none), got {softcap}")


def softcap_math(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """Scaled scores after softcapping, `c·tanh(s/c)` (unchanged for c = 0): the reference's math."""
    return s if not softcap else softcap * torch.tanh(s / softcap)


FULL = AttnSpec()
CAUSAL = AttnSpec(causal=True)
