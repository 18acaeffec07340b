"""launch/text_plots.py: a run's held-out curve recorded from its TensorBoard scalars, and plotted."""

from __future__ import annotations

import json
import math

from tests.dist_utils import launch_script

text_plots = launch_script("text_plots")


def test_record_and_plot_a_heldout_curve(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    docs = tmp_path / "docs"
    for i in range(30):
        (docs / f"d{i % 2}").mkdir(parents=True, exist_ok=True)
        (docs / f"d{i % 2}" / f"f{i}.txt").write_bytes(bytes(97 + (i + j) % 26 for j in range(100 + 7 * i)))
    run = tmp_path / "run"
    curve, losses = {0: 7.9, 5: 6.1, 10: 5.2}, {s: 0.5 + s / 7 for s in range(1, 11)}
    with SummaryWriter(str(run / "tb" / "launch1")) as w:
        for s, v in curve.items():
            w.add_scalar("heldout/bpb", v, s)
        for s, v in losses.items():
            w.add_scalar("loss", v, s)
    overrides = [f"--data.path={docs}", "--data.files=**/*.txt", "--data.seq_len=128", "--parallel.cp=1",
                 "--train.device=cpu"]  # fmt: skip
    rec = text_plots.record_run(run, "configs/text_cpu.toml", overrides, directory=tmp_path)
    stored = json.loads((tmp_path / "training.jsonl").read_text())
    assert stored["results"] == rec["results"]
    assert [r["step"] for r in stored["results"]] == [0, 5, 10]
    assert [r["held-out bpb"] for r in stored["results"]] == [7.9, 6.1, 5.2]
    assert stored["results"][0]["train loss (bits/token)"] is None
    assert abs(stored["results"][2]["train loss (bits/token)"] - losses[10] / math.log(2)) < 1e-3
    a = stored["args"]
    assert a["train files"] + a["held-out files"] == 30 and a["held-out files"] > 0
    assert a["train bytes"] + a["held-out bytes"] == sum(100 + 7 * i for i in range(30))
    assert set(text_plots.newest_text_records(tmp_path / "training.jsonl")) == {"configs/text_cpu.toml"}
    text_plots.plot(tmp_path / "bpb.png", tmp_path / "training.jsonl")
    assert (tmp_path / "bpb.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
