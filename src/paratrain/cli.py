"""The command line: the only place that parses flags. `paratrain devices | train | eval`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import config as C
from .errors import UserError, one_line
from .interrupt import Stopped
from .rundir import check_writable


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (no usage dump) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"paratrain: error: {message}; see `{self.prog} --help`", file=sys.stderr)
        raise SystemExit(2)


def _add_train_flags(p: argparse.ArgumentParser, skip: set[str] | frozenset = frozenset()) -> None:
    if not skip:
        p.add_argument("--recipe", help="start from a named recipe (see `paratrain recipes`); flags override it")
        p.add_argument("--config", help="YAML file of training options (flags override it)")
    for name, f in C.FIELDS.items():
        if name in skip:
            continue
        flag = f.metadata.get("flag", "--" + name.replace("_", "-"))
        helptext = f"{f.metadata['help']} (default: {f.default})"
        if f.type == "bool":
            p.add_argument(flag, dest=name, action="store_const", const=not f.default, default=None,
                           help=f.metadata["help"])
            continue
        kind = int if "int" in f.type else float if "float" in f.type else str
        choices = f.metadata.get("choices")
        choices = [c for c in choices if c != "custom"] if choices else None  # custom: for paratrain.fit only
        p.add_argument(flag, dest=name, type=kind, default=None, choices=choices,
                       help=helptext, metavar=None if "choices" in f.metadata else name.upper())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="paratrain", description="Data-parallel training of classic image classifiers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    dev = sub.add_parser("devices", help="show the CPU, GPUs, backend, and what --devices auto means")
    dev.add_argument("--json", action="store_true", help="print JSON")
    sub.add_parser("recipes", help="list the recipes that `paratrain train --recipe NAME` takes")
    train = sub.add_parser("train", help="train a model with data, pipeline or hybrid parallelism")
    _add_train_flags(train)
    train.add_argument("--print-split", action="store_true",
                       help="pipeline/hybrid: show the stages, their parameters and counted cost, and exit")
    bench = sub.add_parser("bench", help="measure the same training in every device configuration, with plots")
    bench.add_argument("--model", default="lenet5", choices=C.MODELS[:-1])  # not custom (Python only)
    bench.add_argument("--dataset", default="mnist", choices=C.DATASETS[:-1])
    bench.add_argument("--data-dir")
    bench.add_argument("--no-download", dest="download", action="store_false")
    bench.add_argument("--configs", help="e.g. cpu:1t,cpu:2t,ddp-cpu:2,gpu:1,gpu:2,tower-gpu:2 (default: all here)")
    length = bench.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, default=None, help="epochs per run (default: 2)")
    length.add_argument("--steps", type=int, help="steps per run instead")
    bench.add_argument("--batch-size", type=int, help="global batch (default: the dataset's)")
    bench.add_argument("--repeats", type=int, default=2, help="runs per configuration (default: 2)")
    bench.add_argument("--oversubscribe", action="store_true",
                       help="run configurations with more CPU workers than cores (marked in the report)")
    bench.add_argument("--out", required=True, help="report directory")
    search = sub.add_parser("search", help="hyper-parameter search: many trainings at once (Optuna)")
    from .search import command as search_command

    search_command.add_flags(search)
    _add_train_flags(search, skip=search_command.NOT_TRAIN_FLAGS)
    rep = sub.add_parser("report", help="the bench plots and table for finished training runs")
    rep.add_argument("runs", nargs="+", help="run directories")
    rep.add_argument("--out", required=True, help="report directory")
    pl = sub.add_parser("plan", help="predict scaling to 1..1024 devices from a bench (ring all-reduce model)")
    pl.add_argument("--results", required=True, help="a bench report folder (or its results.json)")
    pl.add_argument("--link", default="measured", help="pcie4, nvlink4, ib-ndr, ethernet-25g, or measured "
                    "(2 local gloo processes; default)")
    pl.add_argument("--bandwidth-gbs", type=float, help="explicit all-reduce bandwidth, GB/s")
    pl.add_argument("--latency-us", type=float, help="explicit per-message latency, microseconds")
    pl.add_argument("--per-device-batch", type=int, help="weak scaling with this batch per device "
                    "(default: the bench's global batch per device)")
    pl.add_argument("--global-batch", type=int, help="strong scaling: this global batch split over the devices")
    pl.add_argument("--max-devices", type=int, default=1024)
    pl.add_argument("--out", help="folder for plan.png and plan.json")
    pl.add_argument("--no-validate", action="store_true",
                    help="skip checking the model against the bench's multi-device rows (which measures this host)")
    ev = sub.add_parser("eval", help="test accuracy and loss of a checkpoint")
    ev.add_argument("--checkpoint", required=True, help="a .pt file or a run directory")
    ev.add_argument("--dataset", choices=C.DATASETS[:-1], help="default: the checkpoint's dataset")
    ev.add_argument("--data-dir", help="default: the checkpoint's")
    ev.add_argument("--no-download", dest="download", action="store_false", default=None)
    ev.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto")
    return parser


def resolve_config(args: argparse.Namespace) -> C.TrainConfig:
    """dataclass defaults <- the resumed run's config or a recipe <- --config YAML <- flags."""
    from . import recipes

    base = C.TrainConfig()
    if args.resume:
        saved = Path(args.resume) / "config.yaml"
        if not saved.is_file():
            raise UserError(f"--resume {args.resume}: no config.yaml there; pass the directory of a paratrain run")
        base = C.from_dict(C.load_yaml(saved))
    elif args.recipe:
        base = C.from_dict(recipes.load(args.recipe))
    values: dict[str, Any] = {}
    if args.config:
        values.update(C.load_yaml(args.config))
    values.update({name: getattr(args, name) for name in C.FIELDS if getattr(args, name) is not None})
    if "batch_size" in values and "batch_per_worker" not in values:
        values["batch_per_worker"] = None  # an explicit global batch overrides a per-worker one
    if values.get("strategy", base.strategy) != base.strategy:  # e.g. resuming a pipeline run with DDP
        values.setdefault("stages", None)
        values.setdefault("split", "auto")
        values.setdefault("devices", "auto")
    return C.validate(C.with_run_dir(C.from_dict(values, base)))


def cmd_devices(args: argparse.Namespace) -> int:
    from . import devices

    info = devices.describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    cpu = info["cpu"]
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, {cpu['memory_gib']} GiB")
    for g in info["gpus"]:
        print(f"GPU {g['index']}: {g['name']}, {g['memory_gib']} GiB, compute capability {g['compute_capability']}")
    if not info["gpus"]:
        print("GPUs: none visible to CUDA")
    print(f"backend: {info['backend']}; --devices auto = {info['auto_devices']} {info['auto_accelerator']} "
          f"worker(s) x {info['threads_per_worker']} thread(s); torch {info['torch_version']}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from . import api, launch, strategies
    from .data import load_for

    cfg = resolve_config(args)
    if args.print_split:
        strategy = strategies.get(cfg.strategy)
        if not strategy.pipelined:
            raise UserError("--print-split shows a pipeline's stages; add --strategy pipeline --stages K")
        print(strategy.split(cfg, load_for(cfg))[1])
        return 0
    if cfg.model == "custom" or cfg.dataset == "custom":  # a resumed run of the user's own network or tensors
        raise UserError(f"{cfg.resume or 'this run'} trains a network or tensors of your own: carry it on in Python, "
                        "paratrain.fit(model=make_net, data=..., config=TrainConfig(resume=...))")
    if not launch.under_torchrun() or launch.torchrun_ranks()[0] == 0:
        check_writable(cfg.out)  # rank 0 writes the run directory (other nodes may not see it)
    summary = api.train(cfg, lambda: load_for(cfg))
    if summary is not None:
        rate = summary["examples_per_sec"]  # None when a resumed run had no step left to train
        print(f"test_accuracy {summary['test_accuracy']:.4f}  test_loss {summary['test_loss']:.4f}  "
              f"examples/sec {f'{rate:.0f}' if rate else '-'}  train_time {summary['train_time_s']:.1f}s  "
              f"steps {summary['steps']}  -> {cfg.out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from . import api

    result = api.evaluate(args.checkpoint, dataset=args.dataset, data_dir=args.data_dir, download=args.download,
                          accelerator=args.accelerator)
    print(f"test_accuracy {result['test_accuracy']:.4f}  test_loss {result['test_loss']:.4f}  "
          f"({result['test_examples']} {result['dataset']} test images, {result['model']}"
          f"{' EMA' if result['ema'] else ''} weights, step {result['step']})")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench, devices, plot
    from .data import load_for

    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, not {args.repeats}")
    for name in ("epochs", "steps", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    check_writable(args.out)
    import torch

    configs = (bench.parse_configs(args.configs) if args.configs
               else bench.default_configs(devices.usable_cores(), torch.cuda.device_count()))
    flags = ["--model", args.model, "--dataset", args.dataset, "--log-every", "20"]
    flags += ["--data-dir", args.data_dir] if args.data_dir else []
    flags += [] if args.download else ["--no-download"]
    flags += ["--steps", str(args.steps)] if args.steps else ["--epochs", str(args.epochs or 2)]
    flags += ["--batch-size", str(args.batch_size)] if args.batch_size else []
    flags += ["--oversubscribe"] if args.oversubscribe else []
    load_for(C.validate(C.TrainConfig(model=args.model, dataset=args.dataset, data_dir=args.data_dir,
                                        download=args.download)))  # a missing dataset fails here, once
    out = Path(args.out)
    report = bench.run_bench(configs, flags, args.repeats, out)
    path = plot.write_report(report, out)
    failed = [r["name"] for r in report["results"] if r["status"] != "ok"]
    print(f"bench: {len(configs) - len(failed)} of {len(configs)} configurations measured"
          f"{' (failed: ' + ', '.join(failed) + ')' if failed else ''}; report: {path}")
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    from .search import command

    values = {name: getattr(args, name) for name in C.FIELDS
              if name not in command.NOT_TRAIN_FLAGS and getattr(args, name, None) is not None}
    return command.run(args, values)


def cmd_report(args: argparse.Namespace) -> int:
    from . import bench, plot

    out = check_writable(args.out)
    results = [bench.result_from_run(Path(run)) for run in args.runs]
    out.mkdir(parents=True, exist_ok=True)
    path = plot.write_report({"context": bench.context(), "results": results}, out, title="paratrain runs")
    print(f"report: {path}")
    return 0


def _validate_plan(plan: Any, results: dict, w: Any, base: dict, link: tuple[float, float],
                   measured: bool) -> list[dict]:
    """Predict the bench's multi-device rows. CPU workers are checked against this host's measured gloo
    link and their measured co-location slowdown; GPU rows against the chosen link."""
    cpu_rows = [r for r in results["results"] if r["status"] == "ok" and r["family"] == "ddp-cpu" and r["devices"] > 1]
    local = link if measured or not cpu_rows else plan.measure_link()
    slowdown = {r["devices"]: plan.measure_colocation(plan.bench_model(results), base["global_batch_size"],
                                                      r["global_batch_size"] // r["devices"], r["devices"])
                for r in cpu_rows}
    checks = [c for c in plan.validate(results, w, *local, slowdown) if c["name"] in {r["name"] for r in cpu_rows}]
    checks += [c for c in plan.validate(results, w, *link) if c["name"] not in {r["name"] for r in cpu_rows}]
    if checks:
        print("validation against the bench (strong scaling at its global batch; CPU rows: measured gloo link, no "
              "overlap (gloo shares the cores with backward), compute x its measured per-worker rate on this host):")
        for c in checks:
            print(f"  {c['name']:<12} measured {c['measured']:>9,.0f} ex/s  predicted {c['predicted']:>9,.0f}  "
                  f"(compute x{c['colocation_slowdown']:.2f})  error {c['error']:+.1%}")
    return checks


def cmd_plan(args: argparse.Namespace) -> int:
    from . import plan

    if args.out:
        check_writable(args.out)
    results = plan.load_results(args.results)
    w, base = plan.workload_from_bench(results)
    if (args.bandwidth_gbs is None) != (args.latency_us is None):
        raise UserError("give both --bandwidth-gbs and --latency-us, or neither")
    if args.bandwidth_gbs is not None:
        if args.bandwidth_gbs <= 0 or args.latency_us < 0:
            raise UserError("--bandwidth-gbs must be positive and --latency-us not negative")
        link, (bw, lat) = "explicit", (args.bandwidth_gbs * 1e9, args.latency_us * 1e-6)
    elif args.link == "measured":
        link, (bw, lat) = "measured (2 local gloo processes)", plan.measure_link()
    elif args.link in plan.LINKS:
        link, (bw, lat) = args.link, plan.LINKS[args.link]
    else:
        raise UserError(f"unknown --link '{args.link}'; choose measured, {', '.join(plan.LINKS)}")
    for name in ("per_device_batch", "global_batch", "max_devices"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    b = args.per_device_batch or base["global_batch_size"]
    print(f"workload: {w.compute_per_example_s * 1e6:.1f} us compute per example and {w.fixed_per_step_s * 1e3:.2f}"
          f" ms fixed per step (bench row {base['name']}), {w.grad_bytes / 1e6:.2f} MB of gradients")
    print(f"link: {link}: {bw / 1e9:.2f} GB/s, {lat * 1e6:.1f} us per message; ring all-reduce "
          "2(N-1)/N x bytes / bandwidth + 2(N-1) x latency")
    print("assumptions: compute per example is constant (linear in the batch); one more 24-byte all-reduce per "
          "step (loss and stop flags); with overlap the gradient all-reduce hides "
          f"in the backward pass ({plan.BACKWARD_FRACTION:.0%} of compute); "
          + (f"strong scaling, global batch {args.global_batch}" if args.global_batch
             else f"weak scaling, {b} examples per device"))
    rows = []
    n = 1
    while n <= args.max_devices:
        kw = {"global_batch": args.global_batch} if args.global_batch else {"per_device_batch": b}
        rows.append((plan.predict(w, n, bw, lat, False, **kw), plan.predict(w, n, bw, lat, True, **kw)))
        n *= 2
    print(f"{'devices':>8}{'ex/s (no overlap)':>20}{'efficiency':>12}{'ex/s (overlap)':>18}{'efficiency':>12}")
    for plain, over in rows:
        print(f"{plain['devices']:>8}{plain['examples_per_sec']:>20,.0f}{plain['efficiency']:>12.1%}"
              f"{over['examples_per_sec']:>18,.0f}{over['efficiency']:>12.1%}")
    checks = [] if args.no_validate else _validate_plan(plan, results, w, base, (bw, lat),
                                                             args.link == "measured")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps({"link": link, "bandwidth": bw, "latency": lat, "rows": rows,
                                                   "validation": checks}, indent=2) + "\n")
        from .plot import plan_curve

        plan_curve(rows, out / "plan.png", link)
        print(f"plan: {out / 'plan.png'}")
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    from . import recipes

    for name, line in recipes.available().items():
        print(f"{name:<18} {line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"devices": cmd_devices, "train": cmd_train, "eval": cmd_eval, "recipes": cmd_recipes,
                "bench": cmd_bench, "report": cmd_report, "plan": cmd_plan, "search": cmd_search}
    try:
        code = commands[args.command](args)
    except UserError as e:
        print(f"paratrain: {'' if isinstance(e, Stopped) else 'error: '}{one_line(e)}", file=sys.stderr)
        code = e.code
    except KeyboardInterrupt:
        print("paratrain: interrupted", file=sys.stderr)
        code = 130
    if args.command == "train":
        from . import launch  # torch is loaded by now

        if launch.under_torchrun():  # a worker of torchrun's group: leave without finalization (see end_process)
            launch.end_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
