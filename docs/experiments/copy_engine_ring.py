"""Experiment: ring transfers by copy engine through torch symmetric memory, against NCCL.

torchrun --standalone --nproc_per_node=2 runs/exp_ce.py [tokens ...]
Push model: each rank writes its block straight into the next rank's receive buffer (a slice of
a symmetric heap, same offset on every rank) with cudaMemcpyAsync on a side stream; stream-ordered
signals say "my receive slot is free" (receiver -> sender) and "written" (sender -> receiver).
ring.py's buffers come from the heap through a proxy for its `torch` (experiment only).

A record of the experiment as it ran, against ring.py at 59fc910 (`git checkout 59fc910` to run
it again): the ring has since asked its comm for `reserve`/`buffer` and sends K and V otherwise,
so it does not run against the current tree. ringflash/transport/copy_engine.py is the transport it became.
"""
import math
import os
import sys
import types

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import ringflash.ring as ring
from ringflash import NullComm, RingComm, nccl_options
from ringflash.ring import pack_kv, ring_backward, ring_forward


class Heap:
    def __init__(self, nbytes, group, dev):
        try:
            symm_mem.enable_symm_mem_for_group(group.group_name)
        except Exception as e:  # not needed (or gone) in newer torch
            print("enable_symm_mem_for_group:", e)
        self.buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=dev)
        self.hdl = symm_mem.rendezvous(self.buf, group)
        self.off = 0

    def empty(self, shape, dtype):
        n = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        start = (self.off + 511) // 512 * 512
        if start + n > self.buf.numel():
            raise RuntimeError("heap full")
        self.off = start + n
        return self.buf[start:start + n].view(dtype).view(shape)


class _T:
    def __init__(self, comm, tag):
        self.comm, self.tag = comm, tag

    def wait(self):
        c = self.comm
        c.heap.hdl.wait_signal(c.prev, channel=2 * self.tag + 1)  # data written into my recv
        torch.cuda.current_stream().wait_stream(c.side)           # my send has been read


class SymmComm:
    def __init__(self, group, heap):
        self.group, self.heap = group, heap
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.next, self.prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        self.side = torch.cuda.Stream(priority=-1)

    def send_recv(self, send, recv, tag=0):
        h = self.heap
        off = recv.data_ptr() - h.buf.data_ptr()
        assert 0 <= off < h.buf.numel() and send.is_contiguous() and recv.is_contiguous(), "recv not in heap"
        h.hdl.put_signal(self.prev, channel=2 * tag)          # my recv slot is free (stream order)
        self.side.wait_stream(torch.cuda.current_stream())    # send is ready
        with torch.cuda.stream(self.side):
            h.hdl.wait_signal(self.next, channel=2 * tag)     # next's slot is free
            dst = h.hdl.get_buffer(self.next, tuple(recv.shape), recv.dtype, storage_offset=off // recv.element_size())
            dst.copy_(send)
            h.hdl.put_signal(self.next, channel=2 * tag + 1)
        return _T(self, tag)


def heap_torch(heap):
    """ring.py's `torch`, with empty/empty_like from the heap."""
    proxy = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.empty = lambda shape, dtype=None, device=None: heap.empty(tuple(shape), dtype)
    proxy.empty_like = lambda t: heap.empty(tuple(t.shape), t.dtype)
    return proxy


def main():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", pg_options=nccl_options(), device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    toks = [int(x) for x in sys.argv[1:]] or [8192, 32768]
    heap = Heap(8 << 30, group, dev)
    real_torch = ring.torch
    for n in toks:
        g = torch.Generator(device=dev).manual_seed(rank)
        q, k, v, do = (torch.randn(1, n, 16, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
        kv = pack_kv(k, v)
        opts = dict(causal=True, scale=128 ** -0.5, layout="zigzag")
        comms = {"nccl": RingComm(group), "copy engine": SymmComm(group, heap), "compute only": NullComm(rank, world)}

        def run(name, q=q, kv=kv, do=do, comms=comms, opts=opts):
            c = comms[name]
            if name == "copy engine":
                heap.off = 0
                ring.torch = heap_torch(heap)
            try:
                o, lse = ring_forward(q, kv, comm=c, **opts)
                dq, dkv = ring_backward(do, q, kv, o, lse, comm=c, **opts)
            finally:
                ring.torch = real_torch
            return o, lse, dq, dkv

        # correctness: copy engine against NCCL, bitwise
        ref = [t.clone() for t in run("nccl")]
        got = [t.clone() for t in run("copy engine")]
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(ref, got))
        res = {}
        for _round in range(3):
            for name in comms:
                iters = max(3, (2 ** 31) // (n * n) * 4)
                for _ in range(2):
                    run(name)
                torch.cuda.synchronize()
                dist.barrier()
                torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(iters):
                    run(name)
                e.record()
                torch.cuda.synchronize()
                ms = torch.tensor([s.elapsed_time(e) / iters], device=dev)
                dist.all_reduce(ms, op=dist.ReduceOp.MAX)
                res.setdefault(name, []).append(ms.item())
        if rank == 0:
            print(f"tokens/rank {n}: bitwise equal to NCCL: {same}; fwd+bwd ms per round (slowest rank): "
                  + "; ".join(f"{k} " + " / ".join(f"{x:.2f}" for x in v) for k, v in res.items()), flush=True)
        ref = got = None
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
