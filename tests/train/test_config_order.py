"""`validate` reports errors in the order of cause: the world size and the parallel degrees before
the lengths that follow from them, the model's shape before how the degrees cut it, the transport
a scheme cannot use by name. Each case has several mistakes; the first reported is the cause."""

from __future__ import annotations

import ast
import inspect

import pytest

from ringflash.train import config_checks
from ringflash.train.config import ConfigError, load_config
from tests.dist_utils import REPO

TINY_CPU = REPO / "configs" / "tiny_cpu.toml"
CP3 = "parallel.cp (3) must divide the world size (2); launch a multiple of cp processes (torchrun --nproc_per_node)"


@pytest.mark.parametrize(
    "args, world, message",
    [
        # tiny_cpu's seq_len 128 and eval_buckets 4 do not split into 2·3 chunks either: those follow from cp.
        (["--parallel.cp=3"], 2, CP3),
        (["--parallel.cp=3"], None, "data.seq_len (128) must be divisible by 6 (2·cp for the zigzag layout, cp=3)"),
        (["--parallel.cp=3", "--data.seq_len=768"], None,
         "data.eval_buckets (4) must be a multiple of 6 (2·cp for the zigzag layout, cp=3), so that each depth bucket "
         "lies in one rank's shard; or set data.eval_samples = 0 (no evaluation)"),
        (["--parallel.cp=4", "--parallel.cp_heads=3", "--data.seq_len=100"], 4,
         "parallel.cp_heads (3) must divide parallel.cp (4)"),
        (["--parallel.cp=2", "--parallel.cp_heads=2", "--model.n_kv_heads=3", "--data.seq_len=100"], 2,
         "model.n_kv_heads (3) must divide model.n_heads (4)"),
        (["--parallel.cp=2", "--parallel.transport=copy-engine", "--parallel.cp_scheme=allgather",
          "--data.seq_len=100"], 2,
         "parallel.transport = copy-engine moves the ring's blocks; parallel.cp_scheme = allgather gathers K/V with "
         "the group's collectives and cannot use it: set transport = nccl, or cp_scheme = ring or auto"),
        (["--parallel.cp=0", "--data.seq_len=100"], 2, "parallel.cp: must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_the_first_error_is_the_cause(args, world, message):
    with pytest.raises(ConfigError) as err:
        load_config(TINY_CPU, args, world_size=world)
    assert str(err.value) == message


def test_a_world_that_fits_passes():
    cfg = load_config(TINY_CPU, ["--parallel.cp=2"], world_size=4)
    assert cfg.parallel.cp == 2


def test_validate_is_small_functions():
    tree = ast.parse(inspect.getsource(config_checks))
    lengths = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and (node.name == "validate" or node.name.startswith("_check"))
    }
    assert lengths["validate"] < 20 and max(lengths.values()) <= 100, lengths
