"""The compatibility matrix's cells that no other test covers: each layout with each feature, the gpt on CPU
workers, against one device with the same feature (for --compile, --activation-checkpointing and
--async-checkpoint: one device without it, which computes the same). Small runs (width 32, 6 steps of SGD with
momentum, dropout 0.1, so every layout's random masks must follow one device's), one reference per feature,
shared by the layouts (see tests/matrix.py for how the marks below make the page). The tower's replicas draw
their dropout masks as one device does in distribution only (features/dropout.py): its runs, and the
references they are compared with, leave dropout out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import earlier_release, max_abs_diff, train_here, weights

from paratrain.checkpoint import files as checkpoint

pytestmark = pytest.mark.integration

STEPS = 6
LAYOUTS = {
    "ddp": ("--strategy", "ddp", "--devices", "2"),
    "tower": ("--strategy", "tower", "--devices", "2", "--dropout", "0"),
    "fsdp": ("--strategy", "fsdp", "--devices", "2"),
    "hsdp": ("--strategy", "hsdp", "--devices", "4", "--shard-size", "2", "--oversubscribe"),
    "tp": ("--strategy", "tp", "--devices", "2"),
    "pipeline": ("--strategy", "pipeline", "--stages", "2", "--devices", "2"),
    "hybrid": ("--strategy", "hybrid", "--stages", "2", "--devices", "4", "--oversubscribe"),
    "fsdp x tp": ("--mesh", "fsdp=2,tp=2", "--oversubscribe"),
    "dp x tp x pp": ("--mesh", "dp=2,tp=2,pp=2", "--oversubscribe"),
    "fsdp x pp": ("--mesh", "fsdp=2,pp=2", "--oversubscribe"),
}
# feature: (its flags, the flags of the one-device run it is compared with); the weight average, clipping,
# accumulation and background checkpoints run together (TOGETHER, below)
FEATURES = {
    "compile": (("--compile",), ()),
    "activation checkpointing": (("--activation-checkpointing", "full"), ()),
    "bf16": (("--precision", "bf16"), ("--precision", "bf16")),
    "16-mixed": (("--precision", "16-mixed"), ("--precision", "16-mixed")),
}
FLOAT32, BF16 = 1e-4, 1.5e-2  # float32: every layout's own gap to one device is at most 1.6e-5 (test_tensor_parallel)


@pytest.fixture(scope="module")
def base(corpus: Path) -> tuple[str, ...]:
    return ("--dataset", "text", "--data-dir", str(corpus), "--model", "gpt", "--width", "32", "--depth", "2",
            "--heads", "2", "--context", "16", "--batch-size", "16", "--steps", str(STEPS), "--optimizer", "sgd",
            "--momentum", "0.9", "--lr", "0.1", "--dropout", "0.1", "--checkpoint-every", "3", "--no-tensorboard")


@pytest.fixture(scope="module")
def one_device(base: tuple[str, ...], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one-device runs, by the flags they add, each run once for the module."""
    root, runs = tmp_path_factory.mktemp("one"), {}

    def run(flags: tuple[str, ...]) -> Path:
        if flags not in runs:
            runs[flags] = root / f"r{len(runs)}"
            assert train_here(runs[flags], *_with(base, flags), "--devices", "1")["world_size"] == 1
        return runs[flags]
    return {"run": run}


def _with(base: tuple[str, ...], flags: tuple[str, ...]) -> tuple[str, ...]:
    """`base` and then `flags`, less SGD's --momentum where `flags` choose another optimizer (which refuses it)."""
    if "--optimizer" in flags:
        momentum = base.index("--momentum")
        base = (*base[:momentum], *base[momentum + 2:])
    return (*base, *flags)


CELLS = [
    # --compile: one layout of each way it compiles (compiled_units): the whole model (ddp), each block (tp;
    # FSDP2's blocks: test_compile), a pipeline's stage (pipeline). hsdp, hybrid and fsdp x tp compiled (gaps
    # 6.0e-8, 3.0e-8, 1.2e-7) until 2026-12-01, and dp x tp x pp (a stage split by tp: 1.2e-7, 94 s) until
    # 2026-12-02: CI's 30 minutes needed their time
    ("ddp", "compile", FLOAT32), ("tp", "compile", FLOAT32), ("pipeline", "compile", FLOAT32),
    ("hsdp", "activation checkpointing", FLOAT32), ("hybrid", "activation checkpointing", FLOAT32),
    ("fsdp x tp", "activation checkpointing", FLOAT32), ("dp x tp x pp", "activation checkpointing", FLOAT32),
    ("tower", "bf16", BF16), ("fsdp", "bf16", BF16), ("hsdp", "bf16", BF16), ("tp", "bf16", BF16),
    ("hybrid", "bf16", BF16), ("fsdp x tp", "bf16", BF16), ("dp x tp x pp", "bf16", BF16),
    ("ddp", "16-mixed", BF16), ("tower", "16-mixed", BF16),
]

@pytest.mark.parametrize(("layout", "feature", "bound"), CELLS, ids=[f"{c[0]}-{c[1]}" for c in CELLS])
@pytest.mark.matrix(  # the gaps measured on the 2-core build machine (EMA: the weights and the average)
    ("ddp", "compile", "1.2e-7"), ("tp", "compile", "1.2e-7"), ("pipeline", "compile", "3.0e-8"),
    ("hsdp", "activation checkpointing", "1.2e-7"), ("hybrid", "activation checkpointing", "1.2e-7"),
    ("fsdp x tp", "activation checkpointing", "1.2e-7"), ("dp x tp x pp", "activation checkpointing", "1.2e-7"),
    ("tower", "bf16", "7.1e-4"), ("fsdp", "bf16", "1.3e-3"), ("hsdp", "bf16", "9.6e-4"), ("tp", "bf16", "4.8e-4"),
    ("hybrid", "bf16", "3.7e-4"), ("fsdp x tp", "bf16", "3.8e-4"), ("dp x tp x pp", "bf16", "3.2e-4"),
    ("ddp", "16-mixed", "3.5e-4"), ("tower", "16-mixed", "7.1e-4"))
def test_a_layout_with_a_feature_equals_one_device_with_it(base: tuple[str, ...], one_device: dict, tmp_path: Path,
                                                           layout: str, feature: str, bound: float) -> None:
    flags, reference = FEATURES[feature]
    one = one_device["run"](reference + _dropout(layout))
    summary = train_here(tmp_path / "run", *base, *LAYOUTS[layout], *flags)
    assert summary["steps"] == STEPS
    assert max_abs_diff(weights(one), weights(tmp_path / "run")) <= bound


# The features written once on the composition, run together: a run a layout with the weight average (and the
# test loss it gives), clipping, accumulation and background checkpoints, against one device with the same (one
# device saving in the loop, which computes alike). Measured: the weights and the average 1.5e-8 from one
# device's (the tower's 1.2e-7).
TOGETHER = ("--ema", "0.9", "--eval-ema", "--accumulate", "2")
CLIP = ("--clip-grad-norm", "0.5")
TOGETHER_LAYOUTS = ["ddp", "tower", "hsdp", "tp", "pipeline", "hybrid", "fsdp x tp", "dp x tp x pp", "fsdp x pp"]


@pytest.mark.parametrize("layout", TOGETHER_LAYOUTS)
@pytest.mark.matrix(  # the gaps measured on the 2-core build machine, the weights' and the average's
    ("ddp", "EMA", "1.5e-8"), ("tower", "EMA", "1.2e-7"), ("tp", "EMA", "1.5e-8"), ("fsdp x tp", "EMA", "1.5e-8"),
    ("dp x tp x pp", "EMA", "1.5e-8"), ("fsdp x pp", "EMA", "1.5e-8"), ("ddp", "clipping", "1.5e-8"),
    ("tower", "clipping", "1.2e-7"), ("hsdp", "clipping", "1.5e-8"), ("tp", "clipping", "1.5e-8"),
    ("fsdp x tp", "clipping", "1.5e-8"), ("dp x tp x pp", "clipping", "1.5e-8"), ("fsdp x pp", "clipping", "1.5e-8"),
    ("pipeline", "EMA", "1.5e-8"), ("hybrid", "EMA", "1.5e-8"), ("pipeline", "clipping", "1.5e-8"),
    ("hybrid", "clipping", "1.5e-8"), ("tower", "accumulation", "1.2e-7"), ("hsdp", "accumulation", "1.5e-8"),
    ("tp", "accumulation", "1.5e-8"), ("fsdp x tp", "accumulation", "1.5e-8"), ("pipeline", "accumulation", "1.5e-8"),
    ("hybrid", "accumulation", "1.5e-8"), ("dp x tp x pp", "accumulation", "1.5e-8"),
    ("fsdp x pp", "accumulation", "1.5e-8"), ("tower", "async checkpoints", "1.2e-7"),
    ("hsdp", "async checkpoints", "1.5e-8"), ("tp", "async checkpoints", "1.5e-8"),
    ("pipeline", "async checkpoints", "1.5e-8"), ("hybrid", "async checkpoints", "1.5e-8"),
    ("fsdp x tp", "async checkpoints", "1.5e-8"), ("dp x tp x pp", "async checkpoints", "1.5e-8"),
    ("fsdp x pp", "async checkpoints", "1.5e-8"))
def test_a_layout_with_the_average_clipping_accumulation_and_background_saves_equals_one_device(
        base: tuple[str, ...], one_device: dict, tmp_path: Path, layout: str) -> None:
    one = one_device["run"](TOGETHER + CLIP + _dropout(layout))
    summary = train_here(tmp_path / "run", *base, *LAYOUTS[layout], *TOGETHER, *CLIP, "--async-checkpoint")
    assert summary["steps"] == STEPS
    run = tmp_path / "run"
    gaps = [max_abs_diff(weights(one), weights(run)), max_abs_diff(_average(one), _average(run))]
    print(f"{layout}: weights {gaps[0]:.2g} from one device's, average {gaps[1]:.2g}")
    assert max(gaps) <= FLOAT32
    assert summary["evaluated_with"] == "ema"
    assert summary["test_loss"] == pytest.approx(json.loads((one / "summary.json").read_text())["test_loss"], abs=1e-5)
    # the clipping bites: unclipped, one device ends elsewhere (measured 0.18)
    assert max_abs_diff(weights(one), weights(one_device["run"](TOGETHER + _dropout(layout)))) > 1e-2
    # the step-3 checkpoint, written while step 4 ran, is whole
    assert [step for step, _ in checkpoint.step_checkpoints(tmp_path / "run" / "checkpoints")] == [3, 6]


def _dropout(layout: str) -> tuple[str, ...]:
    """The dropout flag the one-device run takes to be compared with `layout`'s (the tower's: none)."""
    return ("--dropout", "0") if "--dropout" in LAYOUTS[layout] else ()


# Every layout writes the same step folders (checkpoint/dcp.py) and reads any other's: each is stopped and carried
# on by the next, so that each layout writes once and reads once.
CYCLE = list(LAYOUTS)
RESUMED_UNDER = {layout: CYCLE[(i + 1) % len(CYCLE)] for i, layout in enumerate(CYCLE)}
ADAMW_EMA = ("--optimizer", "adamw", "--lr", "0.003", "--ema", "0.9")


@pytest.mark.parametrize("layout", CYCLE)
@pytest.mark.matrix(("tower", "resume across layouts", "1.2e-7"), ("hsdp", "resume across layouts", "1.0e-6"),
                    ("hybrid", "resume across layouts", "1.1e-6"), ("fsdp x tp", "resume across layouts", "1.1e-6"),
                    ("fsdp x pp", "resume across layouts", "1.1e-6"))
def test_a_layouts_checkpoint_carries_on_under_the_next_layout(base: tuple[str, ...], one_device: dict,
                                                               tmp_path: Path, layout: str) -> None:
    """AdamW with EMA, dropout on: stopped after its step-3 checkpoint and carried on to step 6 under the next
    layout, the weights and the average of one device's run never stopped (measured: 1.2e-7 to 1.2e-6)."""
    after = RESUMED_UNDER[layout]
    dropout = _dropout(layout) or _dropout(after)  # the tower's masks are one device's in distribution only
    train_here(tmp_path / "run", *_with(base, ADAMW_EMA), *LAYOUTS[layout], *dropout, "--steps", "3")
    carried = train_here(tmp_path / "run", "--resume", str(tmp_path / "run"), "--steps", str(STEPS),
                         *LAYOUTS[after], *dropout)
    assert carried["resumed_from_step"] == 3 and carried["steps"] == STEPS
    one = one_device["run"](ADAMW_EMA + dropout)
    assert max_abs_diff(weights(one), weights(tmp_path / "run")) <= FLOAT32
    assert max_abs_diff(_average(one), _average(tmp_path / "run")) <= FLOAT32


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_sharded_weights_are_drawn_whole_and_their_steps_timed(base: tuple[str, ...], tmp_path: Path,
                                                               layout: str) -> None:
    """--histogram-every gathers each sharded weight and gradient whole for rank 0's TensorBoard histograms;
    --time-phases times data, compute (where FSDP's reduce-scatter and tensor parallelism's collectives run,
    inside the backward) and the optimizer, the all-reduce left unmeasured (None, not 0). Neither changes what
    the steps compute."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plain = train_here(tmp_path / "plain", *base, *LAYOUTS[layout])
    args = [a for a in base if a != "--no-tensorboard"]
    seen = train_here(tmp_path / "seen", *args, *LAYOUTS[layout], "--histogram-every", "3", "--time-phases")
    assert plain["step_phases_s"] is None
    phases = seen["step_phases_s"]
    assert phases["allreduce"] is None and phases["compute"] > 0 and phases["optimizer"] > 0, phases
    assert max_abs_diff(weights(tmp_path / "plain"), weights(tmp_path / "seen")) == 0.0
    whole = weights(tmp_path / "seen")
    events = EventAccumulator(str(tmp_path / "seen" / "tb"), size_guidance={"histograms": 0}).Reload()
    drawn = {t for t in events.Tags()["histograms"]}
    assert drawn == {f"{kind}/{name}" for kind in ("weights", "gradients") for name in whole}
    for name, tensor in whole.items():  # every element, not one worker's shard
        counts = [e.histogram_value.num for e in events.Histograms(f"weights/{name}")]
        assert counts == [tensor.numel()] * 2, name  # steps 3 and 6


def _average(run: Path) -> dict:
    """A run's weight average (--ema), named as the model's weights."""
    average = checkpoint.load(run)["ema_model"]
    return {k.removeprefix("module."): v for k, v in average.items() if k != "n_averaged"}


@pytest.mark.parametrize("layout", ["tp", "fsdp x tp"])
def test_a_tensor_parallel_weight_average_carries_on(base: tuple[str, ...], one_device: dict, tmp_path: Path,
                                                     layout: str) -> None:
    """--ema under tensor parallelism, stopped after its step-3 checkpoint and carried on under the same layout:
    the average of the run never stopped, bit for bit (a sharded checkpoint's average comes back split as the
    weights); an earlier release's checkpoint of one device (one whole-model file) carried on under the layout:
    one device's average, within float noise."""
    ema = ("--ema", "0.9")
    train_here(tmp_path / "whole", *base, *LAYOUTS[layout], *ema)
    train_here(tmp_path / "cut", *base, *LAYOUTS[layout], *ema, "--steps", "3")
    assert train_here(tmp_path / "cut", "--resume", str(tmp_path / "cut"), "--steps", str(STEPS))[
        "resumed_from_step"] == 3
    assert max_abs_diff(_average(tmp_path / "whole"), _average(tmp_path / "cut")) == 0.0
    with earlier_release():
        train_here(tmp_path / "one-cut", *base, *ema, "--devices", "1", "--steps", "3")
    train_here(tmp_path / "one-cut", "--resume", str(tmp_path / "one-cut"), "--steps", str(STEPS), *LAYOUTS[layout])
    assert max_abs_diff(_average(one_device["run"](ema)), _average(tmp_path / "one-cut")) <= FLOAT32
