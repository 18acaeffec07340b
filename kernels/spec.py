"""`AttnSpec`: which keys each query of one kernel call sees, as one immutable value.

    AttnSpec()                             # full: every query sees every key
    AttnSpec(causal=True)                  # causal diagonal block: query i sees keys j <= i
    AttnSpec(causal=True, window=(w - 1, 0))  # causal sliding window: i - w < j <= i (w keys, the diagonal
                                              # counted); window=w is the same spec
    AttnSpec(window=(left, right))         # two-sided window: i - left <= j <= i + right (-1: no limit)
    AttnSpec.documents(cu_seqlens, total)  # packed documents (+ causal=, window=)
    AttnSpec(intervals=vis)                # any per-row key intervals (kernels/masks.py `Visibility`)
    AttnSpec(causal=True, softcap=30.0)    # + logit softcapping: scores s -> c·tanh(s/c) before the mask
    AttnSpec.from_window_size((w - 1, 0), causal=True)  # flash_attn's form, errors naming window_size

The public functions take flash_attn's `causal=` / `window_size=` and build the spec where they
are called; everything below them (the ring's masks and steps, the backends) takes the spec. It
is validated once, here, when it is made, and `spec.window` is always the pair `(left, right)`
(or None): one form from there down. `spec.window_size` gives it as `(-1, -1)` when there is
none, for what must travel as plain ints (custom-op arguments, the cross-rank check). A window
or documents become intervals (`Visibility`) only where a kernel needs them:
`spec.intervals_for(q, k)`.

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

__all__ = ["CAUSAL", "FULL", "AttnSpec", "check_softcap", "check_window", "mask_kind", "softcap_math"]

Kind = Literal["full", "causal", "window", "intervals"]


def mask_kind(*, causal: bool, window=None, intervals: bool = False) -> Kind:
    """What a backend is asked to run (`Backend.supports`), from a spec's fields; also for callers
    that know a mask's shape before its tensors exist (a config with packed documents)."""
    if intervals:
        return "intervals"
    if window is not None:
        return "window"
    return "causal" if causal else "full"


@dataclass(frozen=True, eq=False)
class AttnSpec:
    """What each query of one kernel call sees (module docstring).

    Attributes:
        causal: query i sees key j only if j <= i (needs Nq == Nk: a diagonal block).
        window: a pair `(left, right)`: keys i − left ... i + right (kernels/masks.py; with causal
            `(left, 0)`); None: no window. Given as an int w with causal, it is stored as `(w - 1, 0)`.
        intervals: per-row key intervals (`Visibility`), replacing causal and window; Nq, Nk free.
        softcap: c > 0 caps the scaled scores to c·tanh(s/c) (Gemma 2's logit softcapping), before
            the mask; 0.0: none (flash_attn's `softcap=0.0`).
    """

    causal: bool = False
    window: tuple[int, int] | None = None
    intervals: Visibility | None = None
    softcap: float = 0.0

    def __post_init__(self):
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {type(self.causal).__name__}")
        check_softcap(self.softcap)
        object.__setattr__(self, "window", check_window(self.window, self.causal))  # frozen: its one form
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
                  window: tuple[int, int] | int | None = None) -> AttnSpec:
        """Packed documents (`cu_seqlens (n_docs + 1,)` over `total` tokens, batch 1): each token
        sees only its own document, causally and within `window` if asked."""
        return cls(intervals=varlen_visibility(cu_seqlens, total, causal=causal, window=window))

    @classmethod
    def from_window_size(cls, window_size, *, causal: bool) -> AttnSpec:
        """flash_attn's `window_size=(left, right)` (-1: no limit on that side) with `causal`: the spec
        whose `window` is that pair (with causal `(w - 1, -1)` read as `(w - 1, 0)`, and `(-1, 0)` as
        no window). Raises TypeError/ValueError naming `window_size`."""
        if not isinstance(window_size, (tuple, list)):
            raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
        return cls(causal=causal, window=check_window(tuple(window_size), causal, "window_size"))

    @property
    def window_size(self) -> tuple[int, int]:
        """The window in flash_attn's form `(left, right)`, `(-1, -1)` for none; `from_window_size`
        gives the same spec back."""
        return self.window if self.window is not None else (-1, -1)

    @property
    def kind(self) -> Kind:
        return mask_kind(causal=self.causal, window=self.window, intervals=self.intervals is not None)

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
