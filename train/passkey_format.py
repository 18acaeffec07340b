"""The passkey task's text (the filler, the key sentence, its repetition, the query) and what one
depth bucket of a sequence must hold: what `data.py` builds sequences from, and what the
configuration's checks (`config_checks.py`) refuse before any rank builds them. It imports only the
configuration's schema, so that both can use it.
"""

from __future__ import annotations

from ringflash.train.config_schema import ConfigError, DataConfig

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY = "The pass key is #{key}. Remember it. "
REPEAT = "#{key} is the pass key. "  # follows KEY after a random stretch of filler
QUERY = "What is the pass key? The pass key is #"


def check_passkey_fits(cfg: DataConfig) -> None:
    """ConfigError unless one depth bucket of `cfg.seq_len` holds the key, its gaps and repetitions
    and the query, so that the last bucket is reachable (the configuration's checks call it too)."""
    key = "0" * cfg.passkey_digits
    key_len, repeat_len = len(KEY.format(key=key)), len(REPEAT.format(key=key))
    need = key_len + cfg.passkey_repeats * (cfg.passkey_gap + repeat_len) + len(QUERY) + cfg.passkey_digits
    if need > cfg.seq_len // cfg.eval_buckets:
        raise ConfigError(
            f"data.seq_len ({cfg.seq_len}) too short for passkey with {cfg.eval_buckets} buckets: each bucket "
            f"({cfg.seq_len // cfg.eval_buckets} tokens) must hold the key, its gaps and repetitions and the "
            f"query ({need} tokens); raise data.seq_len or lower data.eval_buckets, data.passkey_gap "
            f"({cfg.passkey_gap}), data.passkey_repeats ({cfg.passkey_repeats}) or data.passkey_digits "
            f"({cfg.passkey_digits})"
        )
