"""Training features of the tutorials: schedules, EMA, accumulation, augmentation, checkpoints, NaN stop."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import max_abs_diff, run_cli, train, train_here, weights

import paratrain
from paratrain import config
from paratrain import fit as paratrain_fit
from paratrain.checkpoint import files as checkpoint
from paratrain.core.errors import UserError
from paratrain.data import load_dataset
from paratrain.data.transforms import Augment, BatchPipeline
from paratrain.optimization.optim import ema_decay, lr_factor, make_ema, make_optimizer, make_scheduler
from paratrain.parallel import runplan, strategies
from paratrain.runtime import dist
from paratrain.runtime.devices import Hardware
from paratrain.training.worker import work


def _cfg(**kw: object) -> config.TrainConfig:
    return config.validate(config.TrainConfig(**kw))


def fit(cfg: config.TrainConfig, data: object, parts: object = None) -> dict | None:
    """One worker in this process, planned as every run is (runplan.make); it carries on from the newest
    checkpoint in cfg.out, as every worker does."""
    plan = runplan.make(strategies.checked(cfg), lambda: data, parts, hardware=Hardware("cpu", 1, 1, "gloo"))
    return work(0, 1, 0, None, plan, None)


def _fit(tmp_path: Path, name: str, **kw: object) -> dict:
    cfg = _cfg(out=str(tmp_path / name), quiet=True, tensorboard=False, **kw)
    return fit(cfg, load_dataset(cfg.dataset, val_size=cfg.val_size))


# ---- learning-rate schedules -------------------------------------------------------------------------

def _lrs(cfg: config.TrainConfig, steps: int, per_epoch: int = 10) -> list[float]:
    opt = make_optimizer(cfg, [torch.nn.Parameter(torch.zeros(1))])
    sched = make_scheduler(cfg, opt, steps, per_epoch)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_staircase_decay_changes_exactly_at_the_boundaries() -> None:
    cfg = _cfg(lr=0.1, lr_schedule="exponential", lr_decay_rate=0.1, lr_decay_steps=350, lr_staircase=True)
    lrs = _lrs(cfg, 1051)
    assert lrs[0] == lrs[349] == pytest.approx(0.1)
    assert lrs[350] == lrs[699] == pytest.approx(0.01)
    assert lrs[700] == pytest.approx(0.001) and lrs[1050] == pytest.approx(1e-4)


def test_smooth_exponential_and_epoch_periods() -> None:
    cfg = _cfg(lr=1.0, lr_schedule="exponential", lr_decay_rate=0.5, lr_decay_epochs=2)
    assert lr_factor(cfg, 10, 100, steps_per_epoch=10) == pytest.approx(0.5**0.5)
    assert lr_factor(cfg, 20, 100, steps_per_epoch=10) == pytest.approx(0.5)
    step_cfg = _cfg(lr=1.0, lr_schedule="step", lr_decay_rate=0.5, lr_decay_steps=4)
    assert [lr_factor(step_cfg, s, 100, 10) for s in (3, 4, 7, 8)] == [1.0, 0.5, 0.5, 0.25]


def test_warmup_then_cosine() -> None:
    cfg = _cfg(lr=1.0, lr_schedule="cosine", warmup_steps=4)
    lrs = _lrs(cfg, 104)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[54] == pytest.approx(0.5)  # half-way through the cosine
    assert lr_factor(cfg, 104, 104, 10) == pytest.approx(0.0, abs=1e-12)


def test_schedule_needs_a_period(capsys: pytest.CaptureFixture) -> None:
    from paratrain.cli import main

    assert main(["train", "--lr-schedule", "step"]) == 2
    assert "needs --lr-decay-steps or --lr-decay-epochs" in capsys.readouterr().err


# ---- EMA -----------------------------------------------------------------------------------------------

def test_ema_matches_a_hand_computation() -> None:
    model = torch.nn.Linear(2, 1, bias=False)
    ema = make_ema(model, decay=0.9)
    expected = None
    for n, value in enumerate([1.0, 3.0, -2.0, 5.0, 0.5]):
        with torch.no_grad():
            model.weight.fill_(value)
        ema.update_parameters(model)
        if expected is None:
            expected = value  # the first update copies the weights
        else:
            d = min(0.9, (1 + n) / (10 + n))
            expected = d * expected + (1 - d) * value
        assert ema.module.weight[0, 0].item() == pytest.approx(expected, rel=1e-6)
    assert ema_decay(0.9999, 0) == pytest.approx(0.1) and ema_decay(0.9999, 10**7) == 0.9999


def test_ema_averages_batchnorm_running_statistics_too() -> None:
    """use_buffers: the running mean of a BatchNorm layer is averaged like the weights (a copy left at its
    first value would judge the averaged weights with stale statistics)."""
    model = torch.nn.BatchNorm1d(1)
    ema = make_ema(model, decay=0.9)
    means = []
    for value in (1.0, 3.0, 5.0):
        with torch.no_grad():
            model.running_mean.fill_(value)
        ema.update_parameters(model)
        means.append(ema.module.running_mean.item())
    d1, d2 = min(0.9, 2 / 11), min(0.9, 3 / 12)
    first = 1.0
    second = d1 * first + (1 - d1) * 3.0
    assert means == pytest.approx([first, second, d2 * second + (1 - d2) * 5.0], rel=1e-6)


def test_eval_ema_reports_both(tmp_path: Path) -> None:
    summary = _fit(tmp_path, "ema", steps=30, ema=0.99, eval_ema=True)
    assert summary["evaluated_with"] == "ema"
    assert summary["test_accuracy"] == summary["test_accuracy_ema"] != summary["test_accuracy_raw"]
    state = checkpoint.load(tmp_path / "ema")
    assert state["ema_n_averaged"] == 30 and state["ema_model"].keys() == state["model"].keys()


# ---- accumulation, clipping, precision ---------------------------------------------------------------

def test_accumulation_equals_the_big_batch(tmp_path: Path) -> None:
    common = dict(steps=6, optimizer="sgd", lr=0.05, dropout=0.0)
    _fit(tmp_path, "big", batch_size=256, **common)
    _fit(tmp_path, "acc", batch_size=64, accumulate=4, **common)
    assert max_abs_diff(weights(tmp_path / "big"), weights(tmp_path / "acc")) < 2e-6


@pytest.mark.integration
@pytest.mark.matrix(("ddp", "accumulation", "1.5e-8"))
def test_accumulation_across_two_workers(tmp_path: Path) -> None:
    """no_sync on the inner micro-batches must not change the result."""
    args = ("--steps", "6", "--optimizer", "sgd", "--lr", "0.05")
    train_here(tmp_path / "big", *args, "--batch-size", "256", "--devices", "1")
    train_here(tmp_path / "acc", *args, "--batch-size", "64", "--accumulate", "4", "--devices", "2")
    assert max_abs_diff(weights(tmp_path / "big"), weights(tmp_path / "acc")) < 2e-6  # measured 1.5e-8


def _norm_of_change(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(((a[k].double() - b[k].double()) ** 2).sum().item() for k in a))


def test_clipping_bounds_the_update(tmp_path: Path) -> None:
    """Plain gradient descent at lr 1 with the gradients' norm clipped to 1e-3: one update moves the weights
    by exactly 1e-3 (their gradient's norm is far above it), not less (gradients dropped) or more."""
    _fit(tmp_path, "clipped", steps=1, optimizer="gd", lr=1.0, clip_grad_norm=1e-3, seed=5)
    _fit(tmp_path, "start", steps=1, optimizer="gd", lr=1e-30, seed=5)  # the initial weights, to float precision
    assert _norm_of_change(weights(tmp_path / "clipped"), weights(tmp_path / "start")) == pytest.approx(1e-3,
                                                                                                       rel=1e-3)


class _Recorder(torch.nn.Module):
    """Records the dtype of the activations that pass through it (inside the forward pass)."""

    seen: list[torch.dtype] = []  # in training
    evaluated: list[torch.dtype] = []  # in evaluation (after training began: not the build's example forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            _Recorder.seen.append(x.dtype)
        elif _Recorder.seen:
            _Recorder.evaluated.append(x.dtype)
        return x


def _recorded_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 64), _Recorder(), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("32", torch.float32)])
def test_bf16_autocast_runs_the_forward_in_bf16(tmp_path: Path, precision: str, dtype: torch.dtype) -> None:
    """Training's forwards and evaluation's alike (evaluation ran in float32 under bf16: on a GPU, at float32's
    rate and memory)."""
    from paratrain.components.parts import Parts

    _Recorder.seen.clear()
    _Recorder.evaluated.clear()
    cfg = _cfg(out=str(tmp_path / precision), quiet=True, tensorboard=False, steps=60, precision=precision,
               model="custom")
    summary = fit(cfg, load_dataset("digits"), parts=Parts(model=_recorded_net))
    assert summary["precision"] == precision and summary["test_accuracy"] > 0.5
    assert len(_Recorder.seen) == 60 and set(_Recorder.seen) == {dtype}  # every training step's forward
    assert _Recorder.evaluated and set(_Recorder.evaluated) == {dtype}  # every evaluation's
    # the checkpoint judged again as the run judged it: its autocast too
    _Recorder.evaluated.clear()
    again = paratrain.evaluate(tmp_path / precision, model=_recorded_net)
    assert set(_Recorder.evaluated) == {dtype}
    assert (again["test_accuracy"], again["test_loss"]) == (summary["test_accuracy"], summary["test_loss"])


@pytest.mark.parametrize(("name", "kind", "settings"), [
    ("adam", torch.optim.Adam, {}), ("sgd", torch.optim.SGD, {"momentum": 0.7, "nesterov": True}),
    ("gd", torch.optim.SGD, {"momentum": 0, "nesterov": False}), ("rmsprop", torch.optim.RMSprop, {"momentum": 0.7}),
    ("adagrad", torch.optim.Adagrad, {}), ("adadelta", torch.optim.Adadelta, {}),
    ("adamax", torch.optim.Adamax, {}), ("nadam", torch.optim.NAdam, {}),
])
def test_each_optimizer_is_the_one_named_with_its_settings(name: str, kind: type, settings: dict) -> None:
    cfg = _cfg(optimizer=name, lr=0.03, momentum=0.7, nesterov=name == "sgd", weight_decay=1e-3)
    opt = make_optimizer(cfg, [torch.nn.Parameter(torch.zeros(1))])
    group = opt.param_groups[0]
    assert type(opt) is kind and group["lr"] == 0.03 and group["weight_decay"] == 1e-3
    assert {k: group[k] for k in settings} == settings


def test_the_custom_optimizer_needs_its_factory() -> None:
    from paratrain import UserError

    with pytest.raises(UserError, match="optimizer 'custom' is a factory of yours: pass it"):
        make_optimizer(_cfg(optimizer="custom"), [torch.nn.Parameter(torch.zeros(1))])


def test_weight_decay_and_nesterov_change_the_update_as_torch_does(tmp_path: Path) -> None:
    """Three steps with --weight-decay and --nesterov against the same steps by a hand-built torch.optim.SGD."""
    from paratrain.components.build import initial_model, make_batch_transforms
    from paratrain.data.batches import epoch_permutation, global_batch

    cfg = _cfg(out=str(tmp_path / "r"), quiet=True, tensorboard=False, steps=3, optimizer="sgd", lr=0.05,
               momentum=0.9, nesterov=True, weight_decay=0.01, model="mlp", width=32, depth=1, seed=3)
    data = load_dataset("digits")
    fit(cfg, data)
    net = initial_model(cfg, data)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    prep = make_batch_transforms(cfg, data, torch.device("cpu"))
    perm = epoch_permutation(len(data.train[1]), cfg.seed, 0)
    for i in range(3):
        idx = global_batch(perm, i, cfg.batch_size)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(prep.eval(data.train[0][idx])), data.train[1][idx]).backward()
        opt.step()
    assert max_abs_diff(weights(tmp_path / "r"), net.state_dict()) < 1e-6
    plain = _cfg(**{**cfg.to_dict(), "out": str(tmp_path / "p"), "nesterov": False, "weight_decay": 0.0})
    fit(plain, data)
    assert max_abs_diff(weights(tmp_path / "p"), net.state_dict()) > 1e-4  # the two options do change it


@pytest.mark.parametrize("optimizer", ["gd", "rmsprop", "adagrad", "adadelta"])
def test_every_optimizer_learns(tmp_path: Path, optimizer: str) -> None:
    # Plain gradient descent at lr 0.1 sat on the edge of divergence: 0.55 with 2 threads, 0.14 (loss 4.1)
    # with 1. At half that lr it needs more steps, and reached 0.73-0.89 (seeds 0-2, 1 or 2 threads).
    lr = {"gd": 0.05, "rmsprop": 1e-3, "adagrad": 0.01, "adadelta": 1.0}[optimizer]
    steps = 150 if optimizer == "gd" else 60
    summary = _fit(tmp_path, optimizer, steps=steps, optimizer=optimizer, lr=lr, nesterov=False)
    assert summary["test_accuracy"] > 0.5


# ---- augmentation ----------------------------------------------------------------------------------------

def test_augmentation_shapes_and_determinism() -> None:
    x = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    aug = Augment(random_crop=True, crop_padding=2, hflip=True, brightness=0.2, contrast=0.5)
    pipe = BatchPipeline((0.5,) * 3, (0.25,) * 3, 24, torch.device("cpu"), aug)
    a = pipe.train(x, torch.Generator().manual_seed(1))
    b = pipe.train(x, torch.Generator().manual_seed(1))
    c = pipe.train(x, torch.Generator().manual_seed(2))
    assert a.shape == (16, 3, 24, 24) and a.dtype == torch.float32
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert pipe.eval(x).shape == (16, 3, 24, 24)
    assert torch.equal(pipe.eval(x), pipe.eval(x))


def _unnormalised(pipe: BatchPipeline, x: torch.Tensor, seed: int) -> torch.Tensor:
    return pipe.train(x, torch.Generator().manual_seed(seed)) * 0.25 + 0.5  # back to the 0..1 pixel scale


def test_hflip_mirrors_about_half_the_images_and_nothing_else() -> None:
    x = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    pipe = BatchPipeline((0.5,) * 3, (0.25,) * 3, 8, torch.device("cpu"), Augment(hflip=True))
    out, plain = _unnormalised(pipe, x, 0), x.float() / 255
    flipped = [torch.allclose(o, p.flip(-1), atol=1e-6) for o, p in zip(out, plain, strict=True)]
    kept = [torch.allclose(o, p, atol=1e-6) for o, p in zip(out, plain, strict=True)]
    assert all(f or k for f, k in zip(flipped, kept, strict=True))  # each image whole, mirrored or not
    assert 16 < sum(f and not k for f, k in zip(flipped, kept, strict=True)) < 48


def test_brightness_and_contrast_shift_each_image_within_their_range() -> None:
    x = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    plain = x.float() / 255
    bright = _unnormalised(BatchPipeline((0.5,) * 3, (0.25,) * 3, 8, torch.device("cpu"), Augment(brightness=0.2)),
                           x, 1)
    shift = (bright - plain).flatten(1)
    assert torch.allclose(shift, shift[:, :1].expand_as(shift), atol=1e-5)  # one shift per image
    assert shift[:, 0].abs().max() <= 0.2 + 1e-6 and shift[:, 0].std() > 0.05  # within [-b, b], and drawn
    contrast = _unnormalised(BatchPipeline((0.5,) * 3, (0.25,) * 3, 8, torch.device("cpu"), Augment(contrast=0.5)),
                             x, 2)
    mean = plain.mean(dim=(2, 3), keepdim=True)
    factor = ((contrast - mean) / (plain - mean)).flatten(1)
    usable = (plain - mean).abs().flatten(1) > 0.05
    per_image = torch.stack([f[u].median() for f, u in zip(factor, usable, strict=True)])
    assert ((per_image >= 0.5 - 1e-4) & (per_image <= 1.5 + 1e-4)).all() and per_image.std() > 0.1


def test_random_crop_takes_real_windows() -> None:
    x = torch.arange(2 * 1 * 8 * 8, dtype=torch.uint8).view(2, 1, 8, 8)
    pipe = BatchPipeline((0.0,), (1 / 255,), 5, torch.device("cpu"), Augment(random_crop=True))
    out = pipe.train(x, torch.Generator().manual_seed(0)).round().to(torch.uint8)  # undo normalisation
    for i in range(2):
        windows = [x[i, 0, r:r + 5, c:c + 5] for r in range(4) for c in range(4)]
        assert any(torch.equal(out[i, 0], w) for w in windows)


def test_random_crop_reaches_every_offset() -> None:
    """Offsets 0..side-size on both axes, each drawn (an off-by-one never takes the first or last row)."""
    n, side, size = 400, 8, 5
    x = torch.arange(side * side, dtype=torch.uint8).view(1, 1, side, side).expand(n, 1, side, side).contiguous()
    pipe = BatchPipeline((0.0,), (1 / 255,), size, torch.device("cpu"), Augment(random_crop=True))
    corner = pipe.train(x, torch.Generator().manual_seed(0)).round().long()[:, 0, 0, 0]  # = row * side + column
    offsets = {(int(c) // side, int(c) % side) for c in corner}
    assert offsets == {(r, c) for r in range(side - size + 1) for c in range(side - size + 1)}


def test_eval_uses_the_centre_crop() -> None:
    x = torch.arange(36, dtype=torch.uint8).view(1, 1, 6, 6)
    pipe = BatchPipeline((0.0,), (1 / 255,), 4, torch.device("cpu"), Augment(random_crop=True, hflip=True))
    assert torch.equal(pipe.eval(x).round().to(torch.uint8), x[..., 1:5, 1:5])


# ---- checkpoints, resume, NaN stop -------------------------------------------------------------------------

def test_resume_restores_schedule_ema_augmentation_and_dropout(tmp_path: Path) -> None:
    features = dict(model="mnist-net", dropout=0.3, lr_schedule="cosine", warmup_steps=5, ema=0.9,
                    random_crop=True, crop_padding=2, hflip=True, seed=4, checkpoint_every=7)
    _fit(tmp_path, "whole", steps=30, **features)
    _fit(tmp_path, "part", steps=30, max_time=1e-9, **features)  # stops after its first update
    part = checkpoint.load(tmp_path / "part")
    assert part["step"] == 1
    cfg = _cfg(out=str(tmp_path / "part"), resume=str(tmp_path / "part"), quiet=True, tensorboard=False,
               steps=30, **features)
    fit(cfg, load_dataset("digits"))
    whole, resumed = checkpoint.load(tmp_path / "whole"), checkpoint.load(tmp_path / "part")
    assert resumed["step"] == 30
    assert max_abs_diff(whole["model"], resumed["model"]) < 1e-6  # measured 0.0
    assert max_abs_diff(whole["ema_model"], resumed["ema_model"]) < 1e-6


def test_keep_checkpoints(tmp_path: Path) -> None:
    _fit(tmp_path, "keep", steps=20, checkpoint_every=5, keep_checkpoints=2)
    files = sorted(p.name for p in (tmp_path / "keep" / "checkpoints").iterdir())
    assert files == ["step-00000015", "step-00000020"]
    assert checkpoint.load(tmp_path / "keep")["step"] == 20


@pytest.mark.integration
def test_nan_loss_stops_with_code_3_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "nan"
    proc = run_cli("train", "--quiet", "--out", str(run), "--recipe", "lenet5-mnist", "--dataset", "digits",
                   "--batch-size", "64", "--devices", "2", "--optimizer", "gd", "--lr", "1e6",
                   "--checkpoint-every", "1", "--steps", "50")
    assert proc.returncode == 3, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "the loss became" in err[0] and "at step" in err[0], proc.stderr
    state = checkpoint.load(run)
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    assert state["step"] >= 1


def test_a_nan_stop_names_the_step_it_happened_at(tmp_path: Path) -> None:
    calls = []

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        value = torch.nn.functional.cross_entropy(logits, y)
        return value * float("nan") if len(calls) == 7 else value  # the 7th training step's loss

    from paratrain.components.parts import Parts
    from paratrain.core.errors import UserError

    cfg = _cfg(out=str(tmp_path / "nan"), quiet=True, tensorboard=False, steps=20, checkpoint_every=1)
    data = load_dataset("digits")
    plan = runplan.make(strategies.checked(cfg), lambda: data, Parts(loss=loss), hardware=Hardware("cpu", 1, 1, "gloo"))
    calls.clear()  # the plan tried the loss once
    with pytest.raises(UserError, match="the loss became nan at step 7; stopped before updating") as e:
        work(0, 1, 0, None, plan, None)
    assert e.value.code == 3 and checkpoint.load(tmp_path / "nan")["step"] == 6  # the last good one


def test_max_time_stops_and_saves(tmp_path: Path) -> None:
    summary = _fit(tmp_path, "timed", steps=10_000, max_time=2.0)
    assert summary["stopped_by_time"] and summary["steps"] < 10_000
    assert checkpoint.load(tmp_path / "timed")["step"] == summary["steps"]


# ---- logs ------------------------------------------------------------------------------------------

@pytest.mark.integration
def test_step_lines_and_tensorboard_events(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = run_cli("train", "--out", str(tmp_path / "tb"), "--devices", "1", "--steps", "20", "--log-every", "5",
                   "--histogram-every", "10")
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(s for s in proc.stderr.splitlines() + proc.stdout.splitlines() if s.startswith("step 10/20"))
    assert "loss" in line and "examples/sec" in line and "sec/batch" in line
    events = EventAccumulator(str(tmp_path / "tb" / "tb"), size_guidance={"histograms": 0}).Reload()
    tags = events.Tags()
    assert {"train/loss", "train/train_accuracy", "train/lr", "train/examples_per_sec", "val/accuracy"} <= set(
        tags["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == [5, 10, 15, 20]
    assert any(t.startswith("weights/") for t in tags["histograms"])
    assert any(t.startswith("gradients/") for t in tags["histograms"])


# ---- recipes ----------------------------------------------------------------------------------------

def test_recipes_list_and_validate(capsys: pytest.CaptureFixture) -> None:
    from paratrain.cli import main
    from paratrain.config import recipes

    names = {"lenet5-mnist", "convnet-mnist", "mnist-net-sgd", "cifar10-tutorial", "mnist-fast", "cifar10-fast"}
    assert names <= set(recipes.available())
    for name in names:
        config.validate(config.from_dict(recipes.load(name)))
    assert main(["recipes"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in listing) == sorted(recipes.available())
    assert names <= {line.split()[0] for line in listing}


def test_flags_override_a_recipe() -> None:
    from paratrain.cli import build_parser, resolve_config

    args = build_parser().parse_args(["train", "--recipe", "cifar10-tutorial", "--lr", "0.05", "--batch-size",
                                      "64", "--out", "x"])
    cfg = resolve_config(args)
    assert (cfg.model, cfg.lr, cfg.batch_size, cfg.batch_per_worker, cfg.ema) == ("cifar10-net", 0.05, 64, None,
                                                                                  0.9999)
    assert math.isclose(cfg.brightness, 0.247)


def test_unknown_recipe(capsys: pytest.CaptureFixture) -> None:
    from paratrain.cli import main

    assert main(["train", "--recipe", "imagenet-in-an-hour"]) == 2
    assert "unknown recipe 'imagenet-in-an-hour'" in capsys.readouterr().err


@pytest.mark.slow
def test_mnist_fast_reaches_99_percent(tmp_path: Path, mnist_dir: Path) -> None:
    """The mnist-fast recipe as a user runs it (about 13 s on 2 cores)."""
    summary = train(tmp_path / "fast", "--recipe", "mnist-fast", "--data-dir", str(mnist_dir), timeout=600)
    assert summary["test_accuracy"] >= 0.990


# ---- what mutation testing found untested ----

def test_small_images_are_padded_to_the_model_before_a_random_crop() -> None:
    """MNIST's 28 x 28 into LeNet-5's 32 x 32 with --random-crop: padded as evaluation pads, then cropped."""
    from paratrain.data.transforms import Augment, BatchPipeline

    pipe = BatchPipeline((0.0,), (1.0,), 32, torch.device("cpu"), Augment(random_crop=True))
    x = torch.full((4, 1, 28, 28), 255, dtype=torch.uint8)
    out = pipe.train(x, torch.Generator().manual_seed(0))
    assert out.shape == (4, 1, 32, 32)
    assert torch.equal(out, pipe.eval(x))  # no padding beyond the model's size: the only window is the whole


def test_contrast_keeps_each_images_own_channel_means() -> None:
    from paratrain.data.transforms import Augment, BatchPipeline

    pipe = BatchPipeline((0.0, 0.0), (1.0, 1.0), 8, torch.device("cpu"), Augment(contrast=0.5))
    x = torch.randint(0, 256, (6, 2, 8, 8), dtype=torch.uint8)
    x[0, 0] //= 4  # images and channels of very different means
    out = pipe.train(x, torch.Generator().manual_seed(0))
    plain = pipe.eval(x)
    assert torch.allclose(out.mean(dim=(2, 3)), plain.mean(dim=(2, 3)), atol=1e-5)
    assert not torch.allclose(out, plain)


def test_float_images_come_out_float32() -> None:
    from paratrain.data.transforms import unit_scale

    assert unit_scale(torch.rand(2, 1, 4, 4, dtype=torch.float64)).dtype == torch.float32
    x = torch.rand(2, 1, 4, 4)
    assert unit_scale(x) is not x and unit_scale(x).data_ptr() != x.data_ptr()  # a copy: the caller's stays as it is


def test_lr_decay_in_epochs_counts_the_steps_of_an_epoch() -> None:
    cfg = _cfg(lr_schedule="step", lr_decay_epochs=2, lr_decay_rate=0.5)
    opt = make_optimizer(cfg, [torch.nn.Parameter(torch.zeros(1))])
    sched = make_scheduler(cfg, opt, total_steps=100, steps_per_epoch=10)
    lrs = []
    for _ in range(45):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[19] == cfg.lr and lrs[20] == cfg.lr / 2 and lrs[40] == cfg.lr / 4  # halved every 20 steps


def test_a_cosine_schedule_of_one_step_ends_at_zero() -> None:
    assert lr_factor(_cfg(lr_schedule="cosine"), 1, 1, 10) == 0.0


def test_evaluation_gives_the_mean_loss_and_accuracy_of_the_whole_set() -> None:
    """Against cross-entropy and argmax computed directly on the same 50 examples, in batches of 16 that do
    not divide them."""
    from paratrain.data.transforms import BatchPipeline
    from paratrain.optimization.evaluation import evaluate

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
    x = torch.randint(0, 256, (50, 1, 4, 4), dtype=torch.uint8)
    y = torch.randint(0, 3, (50,))
    prep = BatchPipeline((0.5,), (0.25,), 4, torch.device("cpu"))
    accuracy, loss = evaluate(net, (x, y), prep, dist.init(0, 1, "cpu"), batch_size=16)
    with torch.no_grad():
        logits = net(prep.eval(x))
    assert loss == pytest.approx(torch.nn.functional.cross_entropy(logits, y).item(), rel=1e-6)
    assert accuracy == (logits.argmax(1) == y).sum().item() / 50  # exactly: the count of the right ones


# ---- early stopping ------------------------------------------------------------------------------------

def test_early_stopping_ends_the_run_after_patience_epochs_without_a_lower_val_loss(tmp_path: Path) -> None:
    # lr 1e-30: the validation loss never gets lower, so epoch 1 sets the best and epochs 2, 3 run out patience 2
    flat = _fit(tmp_path, "flat", epochs=30, batch_size=256, optimizer="gd", lr=1e-30, early_stopping=2)
    assert flat["stopped_early"] and flat["epochs_validated"] == 3
    learning = _fit(tmp_path, "learning", epochs=3, batch_size=256, optimizer="adam", lr=3e-3, early_stopping=2)
    assert not learning["stopped_early"] and learning["epochs_validated"] == 3  # the loss fell every epoch
    with pytest.raises(UserError, match="--early-stopping watches the validation loss"):
        _cfg(early_stopping=2, val_size=0)
    with pytest.raises(UserError, match="--early-stopping must be at least 1, not 0"):
        _cfg(early_stopping=0)


@pytest.mark.integration
def test_early_stopping_on_two_workers_stops_as_one_and_a_resumed_run_keeps_its_count(tmp_path: Path) -> None:
    """Both workers stop after the epoch one worker stops after (the validation loss they decide on is
    all-reduced), and a run stopped after 2 epochs (one without a lower loss) and resumed on 2 workers stops
    after 1 more, not 2: the count of epochs without a lower loss is carried in the checkpoint."""
    flat = ("--batch-size", "256", "--optimizer", "gd", "--lr", "1e-30", "--early-stopping", "2", "--seed", "3")
    one = train_here(tmp_path / "one", *flat, "--epochs", "30", "--devices", "1")
    two = train_here(tmp_path / "two", *flat, "--epochs", "30", "--devices", "2")
    assert one["stopped_early"] and two["stopped_early"] and two["epochs_validated"] == one["epochs_validated"] == 3
    assert two["steps"] == one["steps"]
    part = train_here(tmp_path / "part", *flat, "--epochs", "2", "--devices", "2")
    assert part["epochs_validated"] == 2 and not part["stopped_early"]
    resumed = train_here(tmp_path / "part", "--resume", str(tmp_path / "part"), "--epochs", "30")
    assert resumed["stopped_early"] and resumed["epochs_validated"] == 3 and resumed["steps"] == two["steps"]


def test_a_checkpoint_at_an_epochs_end_is_validated_on_resume(tmp_path: Path) -> None:
    """Saved at an epoch's last step (before its validation): the resumed run validates that epoch first,
    so early stopping counts it as the uninterrupted run does."""
    common = dict(batch_size=256, optimizer="gd", lr=1e-30, early_stopping=2, seed=3)
    whole = _fit(tmp_path, "whole", epochs=30, **common)
    data = load_dataset("digits")
    per_epoch = len(data.train[1]) // 256  # whole global batches (config.length.steps_per_epoch)
    part = _fit(tmp_path, "part", steps=per_epoch, **common)  # one epoch, saved at its last step
    assert part["epochs_validated"] == 1
    from conftest import edit_meta

    edit_meta(tmp_path / "part", validated=0, early_stopping=(math.inf, 0))  # as written before its validation
    cfg = _cfg(out=str(tmp_path / "part"), resume=str(tmp_path / "part"), epochs=30, quiet=True, tensorboard=False,
               **common)
    resumed = fit(cfg, data)
    assert resumed["stopped_early"] and resumed["epochs_validated"] == whole["epochs_validated"] == 3
    assert resumed["steps"] == whole["steps"]


class StopAt:
    """A search's pruner as a run sees it: asked after every epoch, it says stop at epoch `epoch`."""

    def __init__(self, epoch: int) -> None:
        self.epoch, self.asked = epoch, []

    def __call__(self, epoch: int, figures: dict[str, float]) -> bool:
        self.asked.append((epoch, figures["val_accuracy"]))
        return epoch >= self.epoch


def test_a_run_that_its_pruner_stops_ends_after_that_epochs_validation(tmp_path: Path) -> None:
    cfg = _cfg(out=str(tmp_path / "p"), epochs=5, batch_size=256, quiet=True, tensorboard=False)
    data = load_dataset("digits")
    stop = StopAt(2)
    plan = runplan.make(strategies.checked(cfg), lambda: data, hardware=Hardware("cpu", 1, 1, "gloo"), report=stop)
    summary = work(0, 1, 0, None, plan, None)
    assert summary["pruned"] and summary["epochs_validated"] == 2
    assert summary["steps"] == 2 * (len(data.train[1]) // 256)
    assert [e for e, _ in stop.asked] == [1, 2] and stop.asked[-1][1] == summary["val_accuracy"]


def test_early_stopping_counts_whole_epochs_and_an_early_stopped_run_stays_stopped(tmp_path: Path) -> None:
    # a --max-time stop after the first update: that epoch's validation is no evidence of a stall
    cut = _fit(tmp_path, "cut", epochs=30, batch_size=256, max_time=1e-9, early_stopping=1)
    assert cut["stopped_by_time"] and cut["epochs_validated"] == 0 and not cut["stopped_early"]
    common = dict(batch_size=256, optimizer="gd", lr=1e-30, early_stopping=2)
    flat = _fit(tmp_path, "flat", epochs=30, **common)
    cfg = _cfg(out=str(tmp_path / "flat"), resume=str(tmp_path / "flat"), epochs=30, quiet=True, tensorboard=False,
               **common)
    again = fit(cfg, load_dataset("digits"))
    assert again["stopped_early"] and again["steps"] == flat["steps"]  # resumed, it trains no further
    data = load_dataset("digits")
    no_val = {"train": data.train, "val": (data.val[0][:0], data.val[1][:0]), "test": data.test}
    with pytest.raises(UserError, match="early stopping and a search's pruner watch the validation set"):
        paratrain_fit(None, no_val, _cfg(out=str(tmp_path / "nv"), steps=2, early_stopping=2, quiet=True,
                                         tensorboard=False, devices="1"))
