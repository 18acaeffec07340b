# The vendored peer scripts are torchrun programs, not pytest modules:
# tests/ringflash/test_ring_flash_attn.py runs them.
collect_ignore_glob = ["test_*.py"]
