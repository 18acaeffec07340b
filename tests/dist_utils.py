"""Run a function on N local ranks of a gloo process group: the multi-process test harness.

    results = run_ranks(fn, world=4, args=(q, k, v))   # fn(rank, world, *args) on every rank
    out = torchrun(REPO / "launch" / "train.py", "--config", ...)   # a launch script, as users run it

Every rank is a child process with `torch.distributed` initialised on the default group
(gloo, `rank`, `world`), `torch.set_num_threads(1)` (4 ranks share 2 CI cores, and a forked
child must not enter an OpenMP pool its parent already started). The call returns the ranks'
return values in rank order, or raises `RankFailure` carrying every failed rank's traceback.

Why it is built this way (each point cost someone a slow or hung CI run):
- `fork` starts 4 ranks in ~0.1 s where `spawn` takes seconds, and arguments (tensors too)
  reach the children without pickling. It is safe only while the parent has not initialised
  CUDA; tests that use CUDA pass `start_method="spawn"` (then `fn` and `args` must pickle:
  module-level functions only). tests/conftest.py calls `torch.cuda.is_available()`, which may
  initialise the driver, so GPU tests always spawn.
- Rendezvous through a `FileStore` in a fresh temporary directory, one per call, so concurrent
  test runs never collide and no port is needed. Not a `TCPStore` hosted by the parent: its
  server thread may hold a lock at the moment of `fork`, and a child then hangs in rendezvous
  (seen here: one rank in ~5 runs of 3 ranks).
- A short group timeout (`timeout_s`, default 30 s) makes a mismatched collective fail in
  seconds; the parent also gives up `timeout_s + 15` s after the start, kills what is left and
  reports which ranks never answered. Nothing outlives the call.
- Before spawning, the parent empties its CUDA allocator cache: ranks sharing its GPU need the
  memory for their float64 references (four ranks ran out on an H100 while the pytest process
  still cached 30 GiB from earlier tests).
- Autograd imports `torch.fx.experimental.symbolic_shapes` (and sympy) lazily, on the first
  backward of some ops: ~0.4 s in *every* child. Importing it here, once, in the parent lets
  every fork inherit it.
- Every rank meets the others in a barrier right after `init_process_group`: a rank that
  raised at once used to tear its group down while another was still connecting ("Gloo
  connectFullMesh failed ... Connection closed by peer" in 2 of 60 runs), and under load that
  other rank then failed too, reported as an error of its own.
- Results come back over one pipe per rank; keep them small (numbers, strings), compare
  tensors inside the ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx.experimental.symbolic_shapes  # (see above: inherited by forked ranks)

__all__ = ["REPO", "RankFailure", "launch_script", "run_ranks", "torchrun"]

REPO = Path(__file__).resolve().parent.parent


class RankFailure(AssertionError):
    """One or more ranks raised (or hung); `errors` maps rank -> formatted traceback."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
        super().__init__(f"{len(errors)} rank(s) failed:\n" + "\n".join(parts))


def _child(fn, rank, world, store_path, backend, timeout_s, args, kwargs, conn) -> None:
    torch.set_num_threads(1)
    result: tuple[str, Any]
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
        )
        dist.barrier()  # the group is up everywhere before any rank may fail and tear its end down
        result = ("ok", fn(rank, world, *args, **kwargs))
    except BaseException:  # report everything, including pytest's Failed and KeyboardInterrupt
        result = ("err", traceback.format_exc())
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    try:
        conn.send(result)
    except Exception:  # an unpicklable return value: say so rather than hang the parent
        conn.send(("err", f"rank {rank} returned an unpicklable value:\n{traceback.format_exc()}"))
    conn.close()


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    backend: str = "gloo",
    timeout_s: float = 30.0,
    start_method: str = "fork",
) -> list[Any]:
    """Run `fn(rank, world, *args, **kwargs)` on `world` ranks; return the results in rank order.

    Raises `RankFailure` with the traceback of every rank that raised, and names the ranks that
    did not finish within `timeout_s + 15` seconds (those are killed).
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # ranks sharing this GPU need the memory (see above)
    ctx = mp.get_context(start_method)
    tmpdir = tempfile.mkdtemp(prefix="ringflash_dist_")
    store_path = os.path.join(tmpdir, "store")
    procs, conns = [], []
    try:
        for rank in range(world):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                daemon=True,
                args=(fn, rank, world, store_path, backend, timeout_s, tuple(args), kwargs or {}, send_end),
            )
            p.start()
            send_end.close()  # the parent keeps only the receiving end, so EOF means "child died"
            procs.append(p)
            conns.append(recv_end)
        deadline = time.monotonic() + timeout_s + 15
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = dict(enumerate(conns))
        while pending and time.monotonic() < deadline:
            ready = mp.connection.wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            for conn in ready:
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    status, payload = conn.recv()
                except EOFError:
                    # The pipe closes a moment before the process can be reaped: wait for its exit code.
                    procs[rank].join(timeout=5)
                    status, payload = "err", f"rank {rank} exited without a result (exit code {procs[rank].exitcode})"
                (results if status == "ok" else errors)[rank] = payload
        for rank in pending:
            errors[rank] = f"rank {rank} did not finish within {timeout_s + 15:.0f} s (killed)"
        if errors:
            raise RankFailure(errors)
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in conns:
            c.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def launch_script(name: str):
    """launch/<name>.py as a module (launch/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"launch_{name}", REPO / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torchrun(
    script: Path, *args: str, nproc: int = 2, cwd: Path | None = None, timeout: float = 150
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=nproc script *args` in a subprocess, with this repository
    one OpenMP thread per rank (ringflash installed, e.g. `pip install -e .`); stdout and stderr captured as text."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           *args]  # fmt: skip
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
