"""Where one training step's time goes (`logging.profile_step`): device time by kernel category and
by phase, the collectives' exposed part, and the device's idle time.

    with StepProfile(raw_model, device) as sp:     # around one step
        loss = ...                                  # forward/backward under phase_range("forward") etc.
    result = sp.breakdown(ringflash_kernels(), flops=..., world=..., peak_tflops=...)

The step runs under `torch.profiler.profile` (CPU always, CUDA on CUDA; no trace is exported).
Each device kernel is counted in one **category** by its name:

- attention: the kernels ringflash launches (`ringflash_kernels`, read from kernels/'s source) and
  cuDNN / flash SDPA kernels (names containing `flash`, `fmha` or `cudnn`);
- matmul: cuBLAS / CUTLASS GEMMs (`gemm`, `xmma`, `nvjet`, `cutlass`, `sm90_`);
- collectives: NCCL kernels (`nccl`); their *exposed* part is the time at least one NCCL kernel
  runs while no other kernel does (the union of NCCL intervals minus its overlap with the union of
  all others);
- other: the rest (elementwise, norms, copies, memsets).

Category times are sums of kernel durations: kernels on concurrent streams both count, so they can
add up to more than the busy time (the union of every kernel interval). Idle is wall minus busy.

Each kernel is also counted in one **phase**, by where the CPU launched it: inside a
`phase_range("forward")`, `"backward"` or `"optimizer"` range, or inside a re-run of a module's
forward during backward, which is what activation checkpointing's recompute is (`"recompute"`,
labelled by module hooks while profiling; it is not part of "backward"); else "other" (gradient
clipping, the loss all-reduce). A kernel whose launch the profiler did not link is "unlinked".
FSDP's prefetching launches collectives from hooks, so a collective counts in the phase that
issued it, not necessarily the one it serves.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from ringflash.train.metrics import tflops_per_device

ATTENTION_FRAGMENTS = ("flash", "fmha", "cudnn")
MATMUL_FRAGMENTS = ("gemm", "xmma", "nvjet", "cutlass", "sm90_")
COLLECTIVE_FRAGMENT = "nccl"
CATEGORIES = ("attention", "matmul", "collectives", "other")
PHASES = ("forward", "backward", "recompute", "optimizer")
DEVICE_PHASES = (*PHASES, "other", "unlinked")  # kernels launched outside every phase, or with no known launch
STEP = "step"
_PREFIX = "ringflash.train."  # range names the profile reads back; the prefix keeps them apart from torch's own


def phase_range(phase: str) -> torch.autograd.profiler.record_function:
    """The profiler range that marks a phase of the step (a no-op cost when nothing profiles)."""
    if phase not in (*PHASES, STEP):
        raise ValueError(f"phase must be one of {(*PHASES, STEP)}, got {phase!r}")
    return torch.autograd.profiler.record_function(_PREFIX + phase)


@dataclass(frozen=True)
class Kernel:
    """One device activity: its name, start and end on the device (µs), and when the CPU launched
    it on the profiler's clock (µs; None when the profiler recorded no link to a launch)."""

    name: str
    start: float
    end: float
    launch: float | None = None


def ringflash_kernels(kernel_dir: Path | None = None) -> frozenset[str]:
    """The names of the Triton and Gluon kernels in `kernel_dir` (default: ringflash.kernels's
    folder) that are launched, not inlined: `@triton.jit` / `@gluon.jit` functions that host code
    names other than by calling them (`fn[grid](...)`, or handed to a launcher); the profiler shows
    a launched kernel by its function's name."""
    if kernel_dir is None:
        kernel_dir = Path(importlib.util.find_spec("ringflash.kernels").origin).parent
    names: set[str] = set()
    for path in sorted(Path(kernel_dir).glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        jit_defs = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and any(map(_is_jit, f.decorator_list))]
        jitted = {f.name for f in jit_defs}
        # Names inside jit code are device calls or warp-specialised partitions: parts of a kernel.
        device_code = {id(n) for f in jit_defs for n in ast.walk(f)}
        called = {id(c.func) for c in ast.walk(tree) if isinstance(c, ast.Call)}
        names |= {
            n.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Name) and n.id in jitted and id(n) not in called and id(n) not in device_code
        }
    if not names:
        raise FileNotFoundError(f"no launched @triton.jit / @gluon.jit kernel found in {kernel_dir}")
    return frozenset(names)


def _is_jit(decorator: ast.expr) -> bool:
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(node, ast.Attribute) and node.attr == "jit") or (isinstance(node, ast.Name) and node.id == "jit")


def category(name: str, ours: frozenset[str]) -> str:
    """The category (`CATEGORIES`) of a kernel named `name`; `ours`: `ringflash_kernels()`."""
    low = name.lower()
    if COLLECTIVE_FRAGMENT in low:
        return "collectives"
    # Triton names a kernel by its function; some profilers append a signature or template.
    if name.split("(")[0].split("<")[0].strip() in ours or any(f in low for f in ATTENTION_FRAGMENTS):
        return "attention"
    if any(f in low for f in MATMUL_FRAGMENTS):
        return "matmul"
    return "other"


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of `[start, end)` intervals as sorted disjoint intervals (empty ones dropped)."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals: Iterable[tuple[float, float]]) -> float:
    """The measure of the union of `intervals`."""
    return sum(e - s for s, e in union(intervals))


def overlap(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """The measure of (union of `a`) ∩ (union of `b`)."""
    a, b = union(a), union(b)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def phase_of(launch: float | None, ranges: dict[str, list[tuple[float, float]]]) -> str:
    """The phase whose ranges hold the CPU time `launch`: recompute before backward (it runs inside
    backward's range), 'other' outside them all, 'unlinked' without a launch time."""
    if launch is None:
        return "unlinked"
    for phase in ("recompute", "backward", "forward", "optimizer"):
        if any(s <= launch <= e for s, e in ranges.get(phase, ())):
            return phase
    return "other"


def breakdown(kernels: list[Kernel], ranges: dict[str, list[tuple[float, float]]], ours: frozenset[str]) -> dict:
    """Milliseconds of the step (`ranges[STEP]`, one interval) by category and phase, as the module
    docstring defines them; `ranges[phase]`: the CPU intervals of each phase. Without kernels (a
    CPU run) the device fields are None and only the CPU time of each phase is known."""
    if len(ranges.get(STEP, ())) != 1:
        raise ValueError(f"ranges[{STEP!r}] must hold the step's one interval, got {ranges.get(STEP)}")
    (step_start, step_end), ms = ranges[STEP][0], 1e-3
    recompute = ranges.get("recompute", [])
    cpu = {p: length(ranges.get(p, [])) * ms for p in PHASES}
    cpu["backward"] -= overlap(ranges.get("backward", []), recompute) * ms  # the recompute inside it
    out = {"wall_ms": (step_end - step_start) * ms, "kernels": len(kernels), "phase_cpu_ms": cpu}
    if not kernels:
        return out | {"device_busy_ms": None, "device_idle_ms": None, "device_ms": dict.fromkeys(CATEGORIES),
                      "collectives_exposed_ms": None, "phase_device_ms": dict.fromkeys(DEVICE_PHASES),
                      "top_kernels": None}  # fmt: skip
    by_cat = {c: 0.0 for c in CATEGORIES}
    by_phase = {p: 0.0 for p in DEVICE_PHASES}
    by_name: dict[str, list] = {}
    nccl, rest = [], []
    for k in kernels:
        cat, dur = category(k.name, ours), k.end - k.start
        by_cat[cat] += dur * ms
        by_phase[phase_of(k.launch, ranges)] += dur * ms
        (nccl if cat == "collectives" else rest).append((k.start, k.end))
        entry = by_name.setdefault(k.name, [cat, 0.0, 0])
        entry[1], entry[2] = entry[1] + dur * ms, entry[2] + 1
    busy = length(nccl + rest) * ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    return out | {
        "device_busy_ms": busy,
        "device_idle_ms": out["wall_ms"] - busy,
        "device_ms": by_cat,
        "collectives_exposed_ms": (length(nccl) - overlap(nccl, rest)) * ms,
        "phase_device_ms": by_phase,
        "top_kernels": [{"name": n[:160], "category": c, "ms": t, "count": n_} for n, (c, t, n_) in top],
    }


def collect(events) -> tuple[list[Kernel], dict[str, list[tuple[float, float]]]]:
    """Device kernels and phase ranges from the profiler's raw events
    (`prof.profiler.kineto_results.events()`: `name()`, `device_type()`, `start_ns()`, `end_ns()`,
    `correlation_id()`, `linked_correlation_id()`, `is_user_annotation()`), times in µs from the first.

    A kernel's launch time is its CUDA runtime/driver launch event's start (same correlation id),
    else the start of the CPU op it is linked to. The raw events, not `prof.events()`: torch 2.11's
    FunctionEvent does not carry the link (2.13's does), and there every kernel came out unlinked.
    """
    from torch.autograd import DeviceType

    kernels, ranges, launches, ops, device = [], {}, {}, {}, []
    base = min((e.start_ns() for e in events), default=0)
    for e in events:
        start, end = (e.start_ns() - base) / 1e3, (e.end_ns() - base) / 1e3
        if e.device_type() == DeviceType.CPU:
            if e.name().startswith(_PREFIX):
                ranges.setdefault(e.name()[len(_PREFIX):], []).append((start, end))
            elif e.linked_correlation_id() > 0:
                launches[e.correlation_id()] = start  # a runtime/driver call: the launch's correlation id
            else:
                ops[e.correlation_id()] = start
        elif e.device_type() == DeviceType.CUDA and not getattr(e, "is_user_annotation", lambda: False)():
            device.append((e, start, end))  # device-side copies of user ranges (FSDP's and ours) are not work
    for e, start, end in device:
        launch = launches.get(e.correlation_id(), ops.get(e.linked_correlation_id()))
        kernels.append(Kernel(e.name(), start, end, launch))
    return kernels, ranges


class StepProfile:
    """Profile what runs inside the `with` block: the step. On exit the device is synchronised, so
    the step's range ends when its last kernel does. Module forwards re-run during backward
    (activation checkpointing's recompute) are marked by hooks on `model`'s eager modules."""

    def __init__(self, model: nn.Module, device: torch.device):
        from torch.profiler import ProfilerActivity

        self.model, self.device = model, device
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = None

    def __enter__(self) -> StepProfile:
        from torch.profiler import profile

        self._stack = contextlib.ExitStack()
        self.prof = self._stack.enter_context(profile(activities=self.activities))
        self._stack.enter_context(_RecomputeMarks(self.model))
        self._stack.enter_context(phase_range(STEP))
        return self

    def __exit__(self, *exc) -> bool:
        if self.device.type == "cuda" and exc[0] is None:
            torch.cuda.synchronize(self.device)
        return self._stack.__exit__(*exc)

    def breakdown(self, ours: frozenset[str], flops: float, world: int, peak_tflops: float) -> dict:
        """`breakdown` of the profiled step, with the model TFLOP/s per device over its wall time
        (`flops`: the step's model FLOPs, all `world` ranks together) and the MFU (None without a peak)."""
        out = breakdown(*collect(self.prof.profiler.kineto_results.events()), ours)
        tflops = tflops_per_device(flops, out["wall_ms"] * 1e-3, world)
        return out | {"tflops_per_device": tflops, "mfu": tflops / peak_tflops if peak_tflops > 0 else None}


class _RecomputeMarks:
    """A `phase_range("recompute")` around each outermost module forward that runs during backward.

    Compiled modules get no hooks (new hooks would make dynamo recompile them mid-profile); their
    eager parents carry the marks. The forward hooks run even when the recompute stops early by
    raising (non-reentrant checkpointing's early stop), so every range is closed.
    """

    def __init__(self, model: nn.Module):
        from torch._dynamo.eval_frame import OptimizedModule

        compiled = {id(s) for m in model.modules() if isinstance(m, OptimizedModule) for s in m.modules()}
        self.modules = [m for m in model.modules() if id(m) not in compiled]
        self.depth, self.range, self.handles = 0, None, []

    def _pre(self, module, args):
        if torch._C._current_graph_task_id() == -1:  # not inside a backward pass
            return
        if self.depth == 0:
            self.range = phase_range("recompute").__enter__()
        self.depth += 1

    def _post(self, module, args, output):
        if self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            self.range.__exit__(None, None, None)

    def __enter__(self) -> _RecomputeMarks:
        for m in self.modules:
            self.handles.append(m.register_forward_pre_hook(self._pre))
            self.handles.append(m.register_forward_hook(self._post, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def gather_and_write(mine: dict, step: int, run_dir: Path, is_main: bool) -> list[str]:
    """Every rank's breakdown (`mine`, this rank's) gathered to rank 0, which writes them all to
    <run dir>/profile_step<N>.json and returns the lines to print (the other ranks: none)."""
    import torch.distributed as dist

    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    if not is_main:
        return []
    path = run_dir / f"profile_step{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step": step, "world": len(per_rank), "ranks": per_rank}, indent=1) + "\n")
    return summary_lines(step, per_rank, path)


def summary_lines(step: int, per_rank: list[dict], path: Path) -> list[str]:
    """What rank 0 prints: its own breakdown, the slowest rank's wall and exposed collectives, the file."""
    r0 = per_rank[0]
    mfu = f" | MFU {100 * r0['mfu']:.1f}%" if r0["mfu"] is not None else ""
    head = f"profile of step {step} (rank 0 of {len(per_rank)}): wall {r0['wall_ms']:.1f} ms"
    cpu = " | ".join(f"{p} {v:.1f}" for p, v in r0["phase_cpu_ms"].items())
    if r0["device_busy_ms"] is None:
        lines = [f"{head}{mfu} | no device kernels recorded: device time unavailable",
                 f"  CPU time by phase (ms): {cpu}"]  # fmt: skip
    else:
        cats = " | ".join(f"{c} {v:.1f}" for c, v in r0["device_ms"].items())
        phases = " | ".join(f"{p} {v:.1f}" for p, v in r0["phase_device_ms"].items())
        lines = [
            f"{head} | device busy {r0['device_busy_ms']:.1f} ms, idle {r0['device_idle_ms']:.1f} ms{mfu}",
            f"  device time by category (ms): {cats} (exposed collectives {r0['collectives_exposed_ms']:.1f})",
            f"  device time by phase (ms): {phases}",
        ]
    if len(per_rank) > 1:
        slow = max(range(len(per_rank)), key=lambda r: per_rank[r]["wall_ms"])
        lines.append(f"  slowest rank: {slow} ({per_rank[slow]['wall_ms']:.1f} ms)")
    return [*lines, f"  breakdown of every rank: {path}"]
