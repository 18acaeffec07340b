"""Run configuration: a tree of dataclasses read from TOML and overridable on the command line.

    [model]            ModelConfig       the transformer's shape
    [data]             DataConfig        which task or corpus, sequence length, batch
    [parallel]         ParallelConfig    context-parallel degree and ring layout
    [train]            TrainConfig       optimizer, schedule, precision, step counts
    [checkpoint]       CheckpointConfig  where and how often to save, what to resume
    [logging]          LoggingConfig     run directory, TensorBoard, progress bar

Precedence is CLI > file > defaults: `load_config("configs/x.toml", ["--train.lr=1e-3"])`.
Every field carries its documentation in `metadata["help"]` (printed by `launch/train.py --help`);
unknown sections or keys and values of the wrong type raise `ConfigError` naming the key.

This module reads and overrides; the sections' dataclasses live in `config_schema.py`, the checks
across fields in `config_checks.py` (`validate`), the learning-rate bound in `lr_bound.py`. Every
name is imported from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from pathlib import Path

from ringflash.train.config_checks import check_degrees, validate
from ringflash.train.config_schema import (
    AUTO,
    STDLIB,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    kernel_backend,
    opt,
    resolve_eod_token,
    to_dict,
)
from ringflash.train.lr_bound import (
    EARLY_UPDATE_BOUND,
    EARLY_UPDATE_RUNS,
    check_early_update,
    early_lr,
    early_update_warning,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

__all__ = [  # the sections, checks and learning-rate bound live in their own modules; imported from here
    "AUTO",
    "EARLY_UPDATE_BOUND",
    "EARLY_UPDATE_RUNS",
    "STDLIB",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "check_degrees",
    "check_early_update",
    "describe",
    "early_lr",
    "early_update_warning",
    "kernel_backend",
    "load_config",
    "opt",
    "parse_overrides",
    "resolve_eod_token",
    "to_dict",
    "validate",
]


def _fields(section) -> dict[str, tuple[dataclasses.Field, type]]:
    hints = typing.get_type_hints(type(section))
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(section)}


def _coerce(key: str, value, typ: type, from_cli: bool):
    """`value` as `typ`, or ConfigError. CLI values arrive as strings and are parsed here."""
    if typ == int | str:  # a number or one of the field's keywords (parallel.cp_heads = 4 or "auto")
        if from_cli:
            return int(value) if value.lstrip("+-").isdigit() else value
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected int or str, got {type(value).__name__} {value!r}")
    if typ is dict:  # a table of config keys ([model.hf]); entries are set one by one from the CLI
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table ([{key}] in TOML, --{key}.KEY=VALUE on the command line)")
        return dict(value)
    if from_cli:
        try:
            if typ is bool:
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                return value.lower() in ("true", "1")
            return typ(value)
        except ValueError:
            raise ConfigError(f"{key}: expected {typ.__name__}, got {value!r}") from None
    # TOML values already have types; bool is a subclass of int, so it is checked first.
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (typ is bool) or not isinstance(value, typ):
        raise ConfigError(f"{key}: expected {typ.__name__}, got {type(value).__name__} {value!r}")
    return value


def _set(cfg: Config, key: str, value, from_cli: bool) -> None:
    parts = key.split(".")
    if len(parts) == 3 and isinstance(getattr(getattr(cfg, parts[0], None), parts[1], None), dict):
        # section.table.entry (--model.hf.hidden_size=64): the value is read as TOML, else kept as a string
        if from_cli:
            with contextlib.suppress(tomllib.TOMLDecodeError):
                value = tomllib.loads(f"v = {value}")["v"]
        getattr(getattr(cfg, parts[0]), parts[1])[parts[2]] = value
        return
    if len(parts) != 2:
        raise ConfigError(f"{key}: expected section.key (one of {', '.join(_sections())})")
    section_name, name = parts
    if section_name not in _sections():
        raise ConfigError(f"{key}: unknown section {section_name!r}; sections: {', '.join(_sections())}")
    section = getattr(cfg, section_name)
    fields = _fields(section)
    if name not in fields:
        raise ConfigError(f"{key}: unknown key; [{section_name}] has {', '.join(fields)}")
    f, typ = fields[name]
    value = _coerce(key, value, typ, from_cli)
    choices = f.metadata.get("choices")
    if choices and isinstance(value, str) and value not in choices:
        expected = f"an int or {' or '.join(choices)}" if typ == int | str else f"one of {', '.join(choices)}"
        raise ConfigError(f"{key}: must be {expected}, got {value!r}")
    setattr(section, name, value)


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config)]


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`["--train.lr=1e-3", "--data.kind", "text"]` -> `[("train.lr", "1e-3"), ("data.kind", "text")]`."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(f"{arg}: expected an override of the form --section.key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(args):
            key, value = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(f"{arg}: missing value")
        pairs.append((key, value))
        i += 1
    return pairs


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, world_size: int | None = None
) -> Config:
    """Defaults, then the TOML file at `path`, then `--section.key=value` overrides; validated, against
    the job's `world_size` too if given."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        with open(path, "rb") as fh:
            try:
                table = tomllib.load(fh)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{path}: invalid TOML: {e}") from None
        for section_name, section in table.items():
            if not isinstance(section, dict):
                raise ConfigError(f"{section_name}: expected a [section] table, got a bare key")
            for name, value in section.items():
                _set(cfg, f"{section_name}.{name}", value, from_cli=False)
    for key, value in parse_overrides(overrides or []):
        _set(cfg, key, value, from_cli=True)
    validate(cfg, world_size)
    return cfg



def describe() -> str:
    """Every option with its default and documentation, for `--help`."""
    lines = []
    for section_name in _sections():
        lines.append(f"[{section_name}]")
        section = getattr(Config(), section_name)
        for name, (f, typ) in _fields(section).items():
            lines.append(
                f"  --{section_name}.{name}={getattr(section, name)!r}  ({getattr(typ, '__name__', typ)})  "
                f"{f.metadata['help']}"
            )
    return "\n".join(lines)
