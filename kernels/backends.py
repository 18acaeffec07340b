"""Kernel backends: one object per implementation, chosen once per call and passed down.

    backend = get_backend(None, q.device)           # the name, or RINGFLASH_KERNEL_BACKEND, or auto
    o, lse = backend.fwd_step(q, k, v, spec, scale)  # what the ring calls at every step

- `triton`: our FlashAttention-2 kernels (kernels/triton_fwd.py, triton_bwd.py); on a CPU only in
  Triton's interpreter (`TRITON_INTERPRET=1`), which is how the test suite runs them.
- `reference`: the same contract in plain PyTorch (kernels/reference.py): the CPU path.
- `cudnn`: NVIDIA's cuDNN attention through PyTorch (kernels/cudnn.py): CUDA, fp16/bf16, full or
  causal only. Never chosen by `auto`.
- `hopper`: on an H100/H200 (fp16/bf16, head dim 64 or 128, one head dim for q·k and v; softcap
  with tanh on the MUFU, as FlashAttention's), the forward is a warp-specialised Gluon kernel
  (kernels/hopper_fwd.py) and the backward one Gluon kernel adding dQ atomically
  (kernels/hopper_bwd.py), for every mask: full, causal, windows and per-row intervals (documents,
  a ring's steps, the all-gather). Faster, and dQ not bit-reproducible. Both serve a ring's steps
  (float32 partials, merges, running sums).
  What they cannot run, and backwards under `torch.use_deterministic_algorithms(True)`, runs the
  Triton kernels, with one warning per reason naming both; strict (`get_backend(..., strict=True)`
  or `RINGFLASH_STRICT_BACKEND=1`) raises instead.
`auto` is `hopper` on an H100/H200, `triton` on other GPUs and wherever bit-reproducible gradients
are asked for (`deterministic=True`, `torch.use_deterministic_algorithms(True)`), and the
reference on CPU tensors.

The step API (`fwd_step`, `bwd_step`) is for block-wise callers such as the ring: it writes into
or accumulates into given buffers. The flash_attn-style functions on top
(`kernels.attn_fwd` / `attn_bwd`) return plain new tensors.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable

import torch

from ringflash.kernels.checks import check_grad_out, check_qkv, interpreting
from ringflash.kernels.reference import ref_attn_bwd, ref_attn_fwd
from ringflash.kernels.spec import AttnSpec

__all__ = ["BACKENDS", "Backend", "auto_backend", "backend_named", "device_guard", "get_backend", "interpreting"]

BACKENDS = ("auto", "triton", "reference", "cudnn", "hopper")  # the names `backend=` and the config accept
ENV = "RINGFLASH_KERNEL_BACKEND"
STRICT_ENV = "RINGFLASH_STRICT_BACKEND"  # "1": a backend that cannot run a call raises instead of handing it on

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Backend:
    """One kernel implementation behind the kernel contract (kernels/__init__.py).

    `fwd_step(q, k, v, spec, scale, *, out_dtype=None, acc=None, out=None) -> (o, lse)`:
      o in `out_dtype` (default q's) and lse `(B, H, Nq)` float32, natural log. `acc=(o_acc,
      lse_acc)`: merge this block's result into the running float32 accumulator in place (views
      of larger buffers are fine; `kernels.ref_merge`'s math) and return it. `out`: where the
      (merged) o goes instead, in its own dtype; o_acc is then only read and may be in
      `partial_dtype`.
    `bwd_step(do, q, k, v, o, lse, spec, scale, *, grad_dtype=None, out=None, accumulate=False,
      acc=None, acc_ready=None, after_dkdv=None) -> (dq, dk, dv)`: o and lse may be global (a
      ring's merged ones). `out=(dq, dk, dv)`: write there; `accumulate=True`: add to what out
      holds; `acc=(...)`: add to these sums and write the totals to out, rounded to `grad_dtype`.
      `acc_ready()` is called before acc's (or, accumulating, out's) dk and dv are first read: a
      ring waits there for the sums arriving from the previous rank. The one-kernel backwards
      (`hopper`, `cudnn`) call it after their kernel and add afterwards, so that the sums travel
      while it runs; the Triton backward, before its dK/dV kernel, which adds them on chip.
      `after_dkdv()` is called once dk and dv are final, before dq is computed (`hopper`: after its
      one kernel, which computes all three together).
    """

    name: str
    deterministic = True  # the same inputs give bit-identical results on every run
    softcap = True  # runs `AttnSpec.softcap` (`check` refuses it where not)

    def supports(self, kind: str | None, dtype: torch.dtype | None, head_dim: int | None,
                 device: torch.device | None = None) -> str | None:
        """None if this backend runs attention of this `kind` (an `AttnSpec.kind`: full, causal,
        window, intervals), dtype and head dim, else why not (a message naming the argument).
        What is not known yet (a config checked before any tensor exists) may be None."""
        return None

    def kernels_for(self, dtype: torch.dtype | None, head_dim: int | None, head_dim_v: int | None = None) -> str:
        """The name of the kernels that run such a call on a GPU this backend suits: its own, or
        those it hands the call to (`hopper`: `triton`). The planner predicts at their rates."""
        return self.name

    def check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec) -> None:
        """Raise (naming the argument) if this backend cannot run attention of q over k, v under
        `spec`: what a caller checks before starting work it cannot undo (a ring's transfers)."""

    def partial_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a block's o or gradients come out unrounded in, for inputs of `dtype`."""
        return torch.float32

    def fwd_step(self, q, k, v, spec: AttnSpec, scale: float | None, *, out_dtype=None, acc=None, out=None):
        raise NotImplementedError

    def bwd_step(self, do, q, k, v, o, lse, spec: AttnSpec, scale: float | None, *, grad_dtype=None, out=None,
                 accumulate: bool = False, acc=None, acc_ready: Callable[[], None] | None = None,
                 after_dkdv: Callable[[], None] | None = None) -> Grads:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


class _Triton(Backend):
    name = "triton"

    def fwd_step(self, q, k, v, spec, scale, *, out_dtype=None, acc=None, out=None):
        from ringflash.kernels.triton_fwd import triton_attn_fwd

        return triton_attn_fwd(q, k, v, spec, scale, out_dtype=out_dtype, acc=acc, out=out)

    def bwd_step(self, do, q, k, v, o, lse, spec, scale, *, grad_dtype=None, out=None, accumulate=False, acc=None,
                 acc_ready=None, after_dkdv=None):
        from ringflash.kernels.triton_bwd import triton_attn_bwd

        if acc_ready is not None:  # the dK/dV kernel adds the sums in its epilogue: they must be here
            acc_ready()
        return triton_attn_bwd(do, q, k, v, o, lse, spec, scale, grad_dtype=grad_dtype, out=out,
                               accumulate=accumulate, acc=acc, after_dkdv=after_dkdv)


class _Hopper(_Triton):
    name = "hopper"
    deterministic = False

    def __init__(self, strict: bool = False, chosen_as: str = "hopper"):
        self.strict = strict
        self.chosen_as = chosen_as  # the name the caller asked for: "hopper", or "auto" on an H100/H200
        self._warned: set[tuple[str, str]] = set()  # (direction, reason) pairs warned of

    def kernels_for(self, dtype, head_dim, head_dim_v=None):
        from ringflash.kernels.hopper import unsupported_case

        return "triton" if unsupported_case(dtype, head_dim, head_dim_v) else self.name

    def handed_on(self, direction: str, why: str | None) -> bool:
        """True if the Triton kernels run this call's `direction` ("forward", "backward") because the
        Gluon kernels cannot (`why`): warned once per reason, or raised when strict."""
        if why is None:
            return False
        chosen = "backend='hopper'" if self.chosen_as == "hopper" else "backend='auto' (the Hopper kernels here)"
        text = f"{chosen} cannot run this {direction} on its Gluon kernels: it {why}"
        if self.strict:
            raise ValueError(f"{text} (strict: get_backend(..., strict=True) or {STRICT_ENV}=1 refuses to hand it on)")
        if (direction, why) not in self._warned:
            self._warned.add((direction, why))
            warnings.warn(f"{text}; the Triton kernels (backend='triton') run it instead. Warned once per reason; "
                          f"{STRICT_ENV}=1 makes it an error", stacklevel=4)
        return True

    def fwd_step(self, q, k, v, spec, scale, *, out_dtype=None, acc=None, out=None):
        from ringflash.kernels.hopper_fwd import hopper_attn_fwd, hopper_fwd_unsupported

        check_qkv(q, k, v)  # before the support check reads their attributes
        handed_on = self.handed_on("forward", hopper_fwd_unsupported(q, k, v, spec))
        run = super().fwd_step if handed_on else hopper_attn_fwd
        return run(q, k, v, spec, scale, out_dtype=out_dtype, acc=acc, out=out)

    def bwd_step(self, do, q, k, v, o, lse, spec, scale, *, grad_dtype=None, out=None, accumulate=False, acc=None,
                 acc_ready=None, after_dkdv=None):
        from ringflash.kernels.hopper_bwd import hopper_attn_bwd, hopper_bwd_unsupported

        check_qkv(q, k, v)
        handed_on = self.handed_on("backward", hopper_bwd_unsupported(q, k, v, spec))
        run = super().bwd_step if handed_on else hopper_attn_bwd
        return run(do, q, k, v, o, lse, spec, scale, grad_dtype=grad_dtype, out=out, accumulate=accumulate, acc=acc,
                   acc_ready=acc_ready, after_dkdv=after_dkdv)

    def __repr__(self) -> str:
        return "Backend('hopper', strict=True)" if self.strict else super().__repr__()


class _Unfused(Backend):
    """A backend whose backward returns new gradients: `bwd_step` writes or adds them to the
    caller's buffers in a pass after it (the Triton kernels do that on chip)."""

    def _grads(self, do, q, k, v, o, lse, spec, scale, grad_dtype) -> Grads:
        raise NotImplementedError

    def _add(self, base: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
        if base is out:  # the ring's running sums: added in place
            out.add_(grad)
        else:
            out.copy_(base + grad)

    def bwd_step(self, do, q, k, v, o, lse, spec, scale, *, grad_dtype=None, out=None, accumulate=False, acc=None,
                 acc_ready=None, after_dkdv=None):
        summed = acc is not None or accumulate
        if out is not None or summed:  # before the work, as the Triton path checks
            check_grad_out(out, accumulate, q, k, v, grad_dtype or q.dtype, acc)
        # Added to a sum: rounded after the sum, once, as on chip.
        grads = self._grads(do, q, k, v, o, lse, spec, scale, torch.float32 if summed else grad_dtype)
        if acc_ready is not None:  # the sums are first read by the adds below, not by the kernels
            acc_ready()
        if out is None:
            if after_dkdv is not None:
                after_dkdv()
            return tuple(g.to(grad_dtype or q.dtype) for g in grads)
        base = out if accumulate else (acc or (None, None, None))

        def write(i: int) -> None:
            if base[i] is None:
                out[i].copy_(grads[i])
            else:
                self._add(base[i], grads[i], out[i])

        write(1)
        write(2)
        if after_dkdv is not None:
            after_dkdv()
        write(0)
        return tuple(out)


class _Reference(_Unfused):
    name = "reference"

    def fwd_step(self, q, k, v, spec, scale, *, out_dtype=None, acc=None, out=None):
        return ref_attn_fwd(q, k, v, spec, scale, out_dtype=out_dtype, acc=acc, out=out)

    def _grads(self, do, q, k, v, o, lse, spec, scale, grad_dtype):
        return ref_attn_bwd(do, q, k, v, o, lse, spec, scale, grad_dtype=grad_dtype)


class _Cudnn(_Unfused):
    name = "cudnn"
    deterministic = False
    softcap = False

    def supports(self, kind, dtype, head_dim, device=None):
        from ringflash.kernels.cudnn import cudnn_limits

        return cudnn_limits(kind, dtype, head_dim, device)

    def check(self, q, k, v, spec):
        from ringflash.kernels.cudnn import check_cudnn

        check_cudnn(q, k, v, spec)

    def partial_dtype(self, dtype):
        return dtype  # cuDNN rounds its results to the inputs' dtype: float32 would hold the same values

    def fwd_step(self, q, k, v, spec, scale, *, out_dtype=None, acc=None, out=None):
        from ringflash.kernels.cudnn import cudnn_attn_fwd

        return cudnn_attn_fwd(q, k, v, spec, scale, out_dtype=out_dtype, acc=acc, out=out)

    def _grads(self, do, q, k, v, o, lse, spec, scale, grad_dtype):
        from ringflash.kernels.cudnn import cudnn_attn_bwd

        return cudnn_attn_bwd(do, q, k, v, o, lse, spec, scale)  # rounded by cuDNN whatever grad_dtype

    def _add(self, base, grad, out):
        from ringflash.kernels.triton_passes import add_into

        add_into(base, grad, out)  # one pass on CUDA, summed in float32 and rounded once


_BY_NAME: dict[str, Backend] = {b.name: b for b in (_Triton(), _Reference(), _Cudnn(), _Hopper())}
# The hopper backend by (strict, the name the caller chose: "hopper", or "auto" on an H100/H200,
# which its messages name): one instance each, so that each warns once per reason.
_HOPPERS = {(strict, chosen): _Hopper(strict, chosen) for strict in (False, True) for chosen in ("hopper", "auto")}
_HOPPERS[False, "hopper"] = _BY_NAME["hopper"]


@torch.compiler.assume_constant_result  # a property of the machine: traced code takes its value
@functools.cache
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def auto_backend(device: torch.device, deterministic: bool = False) -> str:
    """The backend `auto` runs for tensors on `device`: `hopper` on an H100/H200 (faster; dQ summed
    atomically), `triton` on other GPUs and where bit-reproducible gradients are asked for
    (`deterministic`, or `torch.use_deterministic_algorithms(True)`), `reference` elsewhere."""
    if device.type != "cuda":
        return "reference"
    if deterministic or torch.are_deterministic_algorithms_enabled() or not _is_sm90(device):
        return "triton"
    return "hopper"


def backend_named(name: str) -> Backend | None:
    """The backend called `name` whatever the device (None for `auto`, which depends on it)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return _BY_NAME.get(name)


def device_guard(t) -> contextlib.AbstractContextManager:
    """Makes `t`'s GPU the current device for the block, as SDPA and flash_attn guard theirs:
    Triton launches, streams, NCCL buffers and `torch.cuda.current_device()` all follow the
    current device, and a script that puts rank r's tensors on `cuda:r` without calling
    `torch.cuda.set_device` must still run there. Nothing for CPU tensors (or non-tensors: the
    argument checks name those), nor under torch.compile, where the ops guard themselves."""
    if isinstance(t, torch.Tensor) and t.is_cuda and not torch.compiler.is_compiling():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def get_backend(backend: str | Backend | None, device: torch.device, *, strict: bool | None = None,
                deterministic: bool = False) -> Backend:
    """The `Backend` that runs for tensors on `device`: `backend` by name (`BACKENDS`), or a
    `Backend` as is, or with None the environment's `RINGFLASH_KERNEL_BACKEND` (default `auto`:
    `auto_backend(device, deterministic)`). `strict` (None: `RINGFLASH_STRICT_BACKEND=1`): `hopper`
    raises where it would hand a call to the Triton kernels. Raises ValueError naming the argument
    or the variable."""
    if isinstance(backend, Backend):
        return backend
    if strict is None:
        flag = os.environ.get(STRICT_ENV, "0")
        if flag not in ("0", "1", ""):
            raise ValueError(f"{STRICT_ENV} must be 0 or 1, got {flag!r}")
        strict = flag == "1"
    choice, source = backend, "backend"
    if choice is None:
        choice, source = os.environ.get(ENV, "auto"), ENV
    if choice not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}, got {choice!r}")
    chosen = choice
    if choice == "auto":
        choice = auto_backend(device, deterministic)
    if choice == "cudnn" and device.type != "cuda":
        raise ValueError(f"{source}='cudnn' needs CUDA tensors, got {device.type} ones: use 'auto' or 'reference'")
    if choice in ("triton", "hopper") and device.type != "cuda" and not interpreting():
        raise ValueError(
            f"backend={choice!r} on a {device.type} tensor needs the Triton interpreter: "
            "set TRITON_INTERPRET=1 before importing triton, or use backend='reference'"
        )
    return _HOPPERS[strict, chosen] if choice == "hopper" else _BY_NAME[choice]
