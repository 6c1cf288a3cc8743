from pathlib import Path

import pytest

import paratrain
from paratrain import config
from paratrain.cli import build_parser, resolve_config
from paratrain.core.errors import UserError


def _resolve(*argv: str) -> config.TrainConfig:
    return resolve_config(build_parser().parse_args(["train", *argv]))


def test_defaults_depend_on_the_dataset() -> None:
    assert _resolve("--out", "x").batch_size == 64  # digits: small set, small batches
    cfg = _resolve("--dataset", "mnist", "--out", "x")
    assert (cfg.batch_size, cfg.epochs) == (512, 5)


def test_flags_override_yaml_which_overrides_defaults(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model: mnist-net\nlr: 0.01\nbatch-size: 100\noptimizer: sgd\n")
    cfg = _resolve("--config", str(path), "--lr", "0.5", "--out", "x")
    assert (cfg.model, cfg.lr, cfg.batch_size, cfg.optimizer) == ("mnist-net", 0.5, 100, "sgd")


def test_every_field_is_a_flag() -> None:
    flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions}
    assert set(config.FIELDS) <= flags


def test_yaml_round_trip(tmp_path: Path) -> None:
    cfg = _resolve("--model", "mlp", "--width", "64", "--devices", "1", "--out", str(tmp_path / "r"))
    config.save_yaml(cfg, tmp_path / "c.yaml")
    assert config.from_dict(config.load_yaml(tmp_path / "c.yaml")) == cfg


def test_resume_takes_the_runs_config_and_its_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    config.save_yaml(config.TrainConfig(model="mlp", lr=0.123, out=str(run)), run / "config.yaml")
    cfg = _resolve("--resume", str(run), "--steps", "99")
    assert (cfg.model, cfg.lr, cfg.steps, cfg.out) == ("mlp", 0.123, 99, str(run))


def test_unknown_key() -> None:
    with pytest.raises(UserError, match="unknown config key"):
        config.from_dict({"epochz": 3})


def test_overlay_drops_what_belonged_to_the_old_strategy_and_batch() -> None:
    """What `--resume RUN --strategy ddp` and paratrain.fit(TrainConfig(resume=RUN, strategy="ddp")) both do."""
    run = config.TrainConfig(strategy="pipeline", stages=2, split="3", devices="2", batch_per_worker=32)
    moved = config.overlay(run, {"strategy": "ddp", "batch_size": 128})
    assert (moved.stages, moved.split, moved.devices, moved.batch_per_worker, moved.batch_size) == (
        None, "auto", "auto", None, 128)
    kept = config.overlay(run, {"steps": 10})
    assert (kept.stages, kept.split, kept.devices, kept.batch_per_worker, kept.steps) == (2, "3", "2", 32, 10)


def test_config_yaml_says_which_of_steps_and_epochs_sets_the_length(tmp_path: Path) -> None:
    by_steps, by_epochs = config.TrainConfig(steps=300, epochs=10), config.TrainConfig(epochs=10)
    for cfg in (by_steps, by_epochs):
        config.save_yaml(cfg, tmp_path / "config.yaml")
        text = (tmp_path / "config.yaml").read_text()
        assert text.startswith("# steps is set: it is the run's length, and epochs is not read\n") == (cfg is by_steps)
        assert config.from_dict(config.load_yaml(tmp_path / "config.yaml")) == cfg


def test_a_decay_period_in_one_unit_drops_the_base_runs_other() -> None:
    """`--resume RUN --lr-decay-epochs 5` on a run decayed every 100 steps: the steps would win over the epochs."""
    run = config.TrainConfig(lr_schedule="step", lr_decay_steps=100)
    assert (config.overlay(run, {"lr_decay_epochs": 5}).lr_decay_steps, config.overlay(run, {}).lr_decay_steps) == (
        None, 100)
    by_epochs = config.TrainConfig(lr_schedule="step", lr_decay_epochs=2.0)
    assert config.overlay(by_epochs, {"lr_decay_steps": 50}).lr_decay_epochs is None


@pytest.mark.integration
def test_configuration_errors_need_no_torch() -> None:
    """strategies.checked asks each strategy for its checks without importing torch (a one-line error is fast)."""
    import subprocess
    import sys

    code = ("import sys, paratrain.config as C\n"
            "from paratrain.parallel.strategies import checked\n"
            "for s in ('ddp', 'tower', 'pipeline', 'hybrid'):\n"
            "    try: checked(C.validate(C.TrainConfig(strategy=s, stages=1)))\n"
            "    except C.UserError as e: print(e)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:4] == ["--stages is for --strategy pipeline or hybrid, not ddp",
                       "--stages is for --strategy pipeline or hybrid, not tower",
                       "--strategy pipeline needs --stages K, 2 or more (the pieces the layers are cut into)",
                       "--strategy hybrid needs --stages K, 2 or more (the pieces the layers are cut into)"]
    assert out[4] == "False"


def test_strings_are_read_as_yaml_reads_them() -> None:
    cfg = paratrain.TrainConfig(lr="0.01", steps="100", quiet="true", devices=2, ema="0.999")
    assert (cfg.lr, cfg.steps, cfg.quiet, cfg.devices, cfg.ema) == (0.01, 100, True, "2", 0.999)
    assert cfg.replace(lr=0.5).lr == 0.5  # replace goes through the same door


def test_every_option_lives_in_one_section() -> None:
    placed = [name for names in config.SECTIONS.values() for name in names]
    assert sorted(placed) == sorted(config.FIELDS) and len(placed) == len(set(placed))


def test_a_gpt_runs_config_yaml_holds_what_it_reads_by_section(corpus: Path, tmp_path: Path) -> None:
    """config.yaml, by section, keeps only the options the run reads (no convnet's kernel in a gpt's, no fsdp
    option under tp, no momentum for AdamW); read back, it is the run's configuration on every option it reads."""
    from paratrain.parallel.strategies import checked, unread_options

    cfg = checked(config.validate(config.TrainConfig(model="gpt", dataset="text", data_dir=str(corpus), width=64,
                                                     heads=2, mesh="dp=2,tp=2", optimizer="adamw")))
    unread = unread_options(cfg)
    config.save_yaml(cfg, tmp_path / "config.yaml", unread)
    text = (tmp_path / "config.yaml").read_text()
    headings = [line[2:] for line in text.splitlines() if line.startswith("# ") and " " not in line[2:]]
    assert headings == list(config.SECTIONS)
    keys = set(config.load_yaml(tmp_path / "config.yaml"))
    assert {"activation", "filters", "kernel", "momentum", "nesterov", "shard_size", "cpu_offload",
            "stages", "param_device"} <= unread and not keys & unread
    assert {"width", "heads", "dropout", "mesh", "tp_plan", "beta1", "lr"} <= keys
    again = config.from_dict(config.load_yaml(tmp_path / "config.yaml"))
    assert all(getattr(again, name) == getattr(cfg, name) for name in config.FIELDS if name not in unread)


def test_adamw_takes_its_betas() -> None:
    """AdamW reads --beta1 and --beta2 (torch.optim.AdamW's betas); they were refused as unread."""
    config.check_read(config.TrainConfig(optimizer="adamw", beta2=0.95), {"beta2"})
    with pytest.raises(UserError, match="--beta2 is not read by --optimizer sgd"):
        config.check_read(config.TrainConfig(optimizer="sgd", beta2=0.95), {"beta2"})
