"""train.metrics.Logger: a progress bar on a terminal only; plain, whole summary lines otherwise."""

from __future__ import annotations

import io

from ringflash.train.metrics import Logger


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream: io.StringIO, capsys) -> tuple[str, str]:
    log = Logger("unused", enabled=True, tensorboard=False, progress_bar=True, stream=stream)
    log.start_progress(0, 3)
    for step in range(1, 4):
        log.advance(2.5 / step)
        log.print(f"step {step} | loss {2.5 / step:.4f}")
    log.close()
    out = capsys.readouterr()
    return out.out, stream.getvalue()


def test_no_bar_when_not_a_terminal(capsys):
    stdout, bar = _run(io.StringIO(), capsys)
    assert bar == ""  # not even a first frame or carriage return
    assert stdout == "step 1 | loss 2.5000\nstep 2 | loss 1.2500\nstep 3 | loss 0.8333\n"


def test_bar_on_a_terminal(capsys):
    stdout, bar = _run(_Terminal(), capsys)
    assert "train:" in bar and "3/3" in bar and "loss=0.8333" in bar
    # Summary lines still come out whole, each on its own line.
    assert [line for line in stdout.splitlines() if line.strip()] == [
        "step 1 | loss 2.5000",
        "step 2 | loss 1.2500",
        "step 3 | loss 0.8333",
    ]
