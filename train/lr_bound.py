"""The learning-rate bound: a run whose first steps move the model too far for its width and depth
is warned about at its start, or refused with `train.strict_lr`. Re-exported by `ringflash.train.config`.
"""

from __future__ import annotations

from ringflash.train.config_schema import ConfigError, TrainConfig

# Adam moves every weight by about lr a step from the first steps on, so a linear layer of fan-in
# n shifts its output by about lr·n of its scale, and the shifts compound over the layers. The
# early update size lr(step 10)·(largest fan-in)·layers sat at 0.28-3.7 in the runs whose loss fell
# from the first steps and at 14 in the ~7B whose loss rose; EARLY_UPDATE_RUNS names their record.
# Wider models tolerate less: the 2.8B (dim 3072) rose once its lr passed ~5e-6, a size of ~1.4, so
# the bound catches gross mistakes at every width, not every rise at large widths.
EARLY_UPDATE_BOUND = 8.0
EARLY_STEPS = 10  # the "first steps" the bound and early_lr speak of
EARLY_UPDATE_RUNS = (
    "runs whose loss fell sat at 0.28-3.7, a ~7B whose loss rose 7 -> 40 at 14: benchmarks/training.jsonl, "
    '"The learning-rate bound\'s runs"; a 2.8B rose at 1.4: benchmarks/acceptance.jsonl'
)


def early_lr(t: TrainConfig) -> float:
    """The learning rate the schedule reaches by step EARLY_STEPS: the peak, or EARLY_STEPS/warmup_steps of it."""
    return t.lr * min(1.0, EARLY_STEPS / t.warmup_steps) if t.warmup_steps else t.lr


def early_update_warning(t: TrainConfig, max_fan_in: int, n_layers: int) -> str | None:
    """A warning when the learning rate of the first steps is too large for the model's width and
    depth (`EARLY_UPDATE_BOUND`), naming what to change and the runs the bound rests on; None when
    it is within what trains."""
    lr10 = early_lr(t)
    size = lr10 * max_fan_in * n_layers
    if size <= EARLY_UPDATE_BOUND:
        return None
    return (
        f"train.lr = {t.lr:g} with train.warmup_steps = {t.warmup_steps} reaches lr {lr10:.3g} by step 10: with "
        f"fan-ins up to {max_fan_in} over {n_layers} layers each step moves the model by about {size:.0f} "
        f"(lr·fan-in·layers), above the {EARLY_UPDATE_BOUND:g} the recorded runs allow ({EARLY_UPDATE_RUNS}), "
        f"and the loss may rise. Lower train.lr or lengthen train.warmup_steps (Llama 3's 8B recipe: lr 3e-4 "
        f"over 2000 warm-up steps)"
    )


def check_early_update(t: TrainConfig, max_fan_in: int, n_layers: int) -> str | None:
    """`early_update_warning`'s text for the run to print at its start, or, with `train.strict_lr`,
    a ConfigError naming that option instead."""
    warning = early_update_warning(t, max_fan_in, n_layers)
    if warning is not None and t.strict_lr:
        raise ConfigError(f"train.strict_lr = true refuses this run: {warning}")
    if warning is not None:
        return f"{warning}; --train.strict_lr=true makes this an error"
    return None

