# Vendored from https://github.com/zhuzilin/ring-flash-attention, test/test_ring_flash_attn_func.py
# at commit 899628238f2f5bb8c028579c89b7cd56ea451d2a (2025-08-04), MIT license,
# Copyright 2024 Zilin Zhu (full notice in ./LICENSE).
# Changed for ringflash, on the lines marked "ringflash:", and nothing else: the import of
# ring_flash_attn (now ringflash.ring_flash_attn), the import of flash_attn's reference
# function (now ./flash_attn_reference.py: float64 math on CPU, flash_attn being CUDA only),
# the process-group backend (gloo for nccl) and the device (cpu for cuda:{rank}).
# Run by tests/ringflash/test_ring_flash_attn.py under torchrun, which asserts on the diffs
# this script logs (it prints them and asserts nothing itself).
import sys
import torch
import torch.distributed as dist
from flash_attn_reference import flash_attn_qkvpacked_func  # ringflash: was `from flash_attn import`
from ringflash.ring_flash_attn import ring_flash_attn_qkvpacked_func  # ringflash: was `from ring_flash_attn import`
from utils import log, set_seed


def main():
    dist.init_process_group("gloo")  # ringflash: was "nccl"
    rank = dist.get_rank()
    set_seed(rank)
    world_size = dist.get_world_size()
    dtype = torch.bfloat16
    device = torch.device("cpu")  # ringflash: was f"cuda:{rank}"

    batch_size = 1
    seqlen = 3816
    nheads = 5
    d = 128
    dropout_p = 0
    causal = True
    deterministic = False

    assert seqlen % world_size == 0
    assert d % 8 == 0

    qkv = torch.randn(
        batch_size, seqlen, 3, nheads, d, device=device, dtype=dtype, requires_grad=True
    )
    dist.broadcast(qkv, src=0)

    dout = torch.randn(batch_size, seqlen, nheads, d, device=device, dtype=dtype)
    dist.broadcast(dout, src=0)

    local_qkv = qkv.chunk(world_size, dim=1)[rank].detach().clone()
    local_qkv.requires_grad = True
    local_dout = dout.chunk(world_size, dim=1)[rank].detach().clone()

    dist.barrier()
    if rank == 0:
        print("#" * 30)
        print("# forward:")
        print("#" * 30)

    out, lse, _ = flash_attn_qkvpacked_func(
        qkv,
        dropout_p=dropout_p,
        causal=causal,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=deterministic,
        return_attn_probs=True,
    )

    local_out = out.chunk(world_size, dim=1)[rank]
    local_lse = lse.chunk(world_size, dim=-1)[rank]

    fn = ring_flash_attn_qkvpacked_func

    ring_out, ring_lse, _ = fn(
        local_qkv,
        dropout_p=dropout_p,
        causal=causal,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=deterministic,
        return_attn_probs=True,
    )

    log("out", out, rank0_only=True)
    log("lse", lse, rank0_only=True)
    log("out diff", local_out - ring_out)
    log("lse diff", local_lse - ring_lse)

    dist.barrier()
    if rank == 0:
        print("#" * 30)
        print("# backward:")
        print("#" * 30)

    out.backward(dout)
    dqkv = qkv.grad
    local_dqkv = dqkv.chunk(world_size, dim=1)[rank]

    ring_out.backward(local_dout)
    ring_dqkv = local_qkv.grad

    log("local_dqkv", local_dqkv)
    log("dq diff", local_dqkv[:, 0] - ring_dqkv[:, 0])
    log("dk diff", local_dqkv[:, 1] - ring_dqkv[:, 1])
    log("dv diff", local_dqkv[:, 2] - ring_dqkv[:, 2])

    dist.destroy_process_group()

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "compile":
        torch._dynamo.config.capture_scalar_outputs = True
        flash_attn_qkvpacked_func = torch.compile(flash_attn_qkvpacked_func)
        ring_flash_attn_qkvpacked_func = torch.compile(ring_flash_attn_qkvpacked_func)
    main()
