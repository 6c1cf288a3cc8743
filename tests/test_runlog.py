"""metrics.jsonl on resume: what a run wrote after the checkpoint it resumes from is dropped, once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.config import TrainConfig
from paratrain.tracking.log import RunLog


def test_a_resumed_run_drops_the_records_after_its_checkpoint_and_the_validation_it_makes_again(
        tmp_path: Path) -> None:
    """The checkpoint of step 20 (the last step of epoch 2) was written before epoch 2's validation: the
    resumed run validates epoch 2 again, so the old line of it goes, with every record after step 20 and a
    torn last line; epoch 1's validation stays."""
    records = [{"step": 10, "epoch": 1, "loss": 1.0}, {"step": 10, "epoch": 1, "epoch_time_s": 1.0},
               {"step": 20, "epoch": 2, "loss": 0.5}, {"step": 20, "epoch": 2, "epoch_time_s": 1.0},
               {"step": 30, "epoch": 3, "loss": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3')
    log = RunLog(tmp_path, True, TrainConfig(tensorboard=False, quiet=True), 40, start_step=20, validated=1)
    log.close()
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == records[:3]
    log = RunLog(tmp_path, True, TrainConfig(tensorboard=False, quiet=True), 40, start_step=20, validated=2)
    log.close()  # a checkpoint made after epoch 2's validation keeps what is left
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == records[:3]


@pytest.mark.parametrize("val_size,said", [(0, "no validation set (--val-size 0)"),
                                           (None, "no validation set")])  # paratrain.fit given an empty one
def test_an_epoch_without_a_validation_set_says_so_not_nan(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                           val_size: int | None, said: str) -> None:
    """The epoch line says there is no validation set, and metrics.jsonl holds nulls."""
    import math

    log = RunLog(tmp_path, True, TrainConfig(tensorboard=False, val_size=val_size), 40, start_step=0)
    log.epoch(step=10, epoch=1, epochs=4, val_accuracy=math.nan, val_loss=math.nan, epoch_time_s=1.5, validated=False)
    log.epoch(step=20, epoch=2, epochs=4, val_accuracy=0.5, val_loss=0.75, epoch_time_s=1.25)
    log.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch")]
    assert lines == [f"epoch 1/4  {said}  1.50s", "epoch 2/4  val_accuracy 0.5000  val_loss 0.7500  1.25s"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["val_accuracy"] is None and records[1]["val_accuracy"] == 0.5
