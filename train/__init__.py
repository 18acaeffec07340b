"""Layer 3: a small decoder-only LM trained with ring attention.

from ringflash.train.config import load_config
from ringflash.train.trainer import train
train(load_config("configs/tiny_cpu.toml", ["--train.steps=50"]))
"""
