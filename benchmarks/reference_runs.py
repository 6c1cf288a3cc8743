"""Reference runs for a refactor that must not change what a run computes: train each kind of run briefly
on the embedded digits and hash what it leaves (the weights, the optimizer state, the EMA, config.yaml with
the work folder's path taken out). Run it before the change and after, on the same machine, and compare.

    python benchmarks/reference_runs.py --save before.json            # on the code before the change
    python benchmarks/reference_runs.py --compare before.json         # after: a table, exit 1 on a difference
    PYTHONPATH=/path/to/old/src python benchmarks/reference_runs.py ...  # another checkout's package
    python benchmarks/reference_runs.py --start-as-before --compare before.json  # from the initial weights of
                                                            # releases before the meta-device build (2026-11-30)

The runs (a few seconds each on 2 cores): ddp on 1 and 2 workers (SGD momentum, EMA), a resume of a
2-worker run, tower, pipeline, hybrid, an imported network (examples/residual_cnn.py), BatchNorm sync,
an image folder (examples/make_shapes.py), a grid search on 2 pool processes, a torchrun run; and each
layout's clipping with AdamW and EMA: ddp, fsdp and hsdp of the mlp, and the gpt (dropout on, its tied
embedding and head) under pp=2, dp=2,pp=2, fsdp=2,pp=2 and dp=2,tp=2, on tests/data's fixed corpus.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
COMMON = ("--quiet", "--no-tensorboard", "--seed", "3")
SGD = ("--optimizer", "sgd", "--lr", "0.02", "--momentum", "0.9")
# every layout's clipping and weight average, with an optimizer that keeps state
CLIPPED = ("--optimizer", "adamw", "--lr", "0.003", "--clip-grad-norm", "0.05", "--ema", "0.9")


def cli(*args: str, torchrun: bool = False) -> None:
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if torchrun \
        else [sys.executable]
    proc = subprocess.run([*head, "-m", "paratrain", *args], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"failed: paratrain {' '.join(args)}\n{proc.stderr[-3000:]}")


def train(run: Path, *args: str, torchrun: bool = False) -> None:
    cli("train", "--out", str(run), *COMMON, *args, torchrun=torchrun)


def cases(work: Path, only: list[str] | None = None) -> dict[str, list[Path]]:
    """Run every reference case in `work` (those named in `only`); each name maps to the run folders it left."""
    shapes = work / "shapes"
    subprocess.run([sys.executable, str(REPO / "examples" / "make_shapes.py"), str(shapes)], check=True,
                   capture_output=True)
    corpus = work / "corpus.txt"
    corpus.write_bytes(gzip.decompress((REPO / "tests" / "data" / "corpus.txt.gz").read_bytes()))
    gpt = ("--model", "gpt", "--dataset", "text", "--data-dir", str(corpus), "--width", "32", "--heads", "2",
           "--depth", "2", "--context", "16", "--batch-size", "8", "--dropout", "0.1", "--steps", "8", *CLIPPED)
    space = work / "space.yaml"
    space.write_text("fixed: {model: mlp, optimizer: sgd, momentum: 0.9}\n"
                     "params:\n  lr: [0.01, 0.03]\n  width: [32, 64]\n")
    runs = {
        "ddp-1": lambda r: train(r, "--devices", "1", "--steps", "30"),
        "ddp-2": lambda r: train(r, "--devices", "2", "--steps", "30", *SGD, "--ema", "0.9"),
        "resume-2": lambda r: (train(r, "--devices", "2", "--steps", "20", *SGD, "--ema", "0.9",
                                     "--checkpoint-every", "10"),
                               cli("train", "--resume", str(r), "--steps", "40", "--quiet")),
        "tower": lambda r: train(r, "--strategy", "tower", "--devices", "2", "--steps", "20", *SGD),
        "pipeline": lambda r: train(r, "--strategy", "pipeline", "--stages", "2", "--devices", "2", "--steps", "20",
                                    "--microbatches", "2", *SGD),
        "hybrid": lambda r: train(r, "--strategy", "hybrid", "--stages", "2", "--devices", "4", "--oversubscribe",
                                  "--steps", "12", "--microbatches", "2", *SGD),
        "imported": lambda r: train(r, "--model", f"{REPO / 'examples' / 'residual_cnn.py'}:build", "--devices", "2",
                                    "--steps", "12", "--optimizer", "adam"),
        "bn-sync": lambda r: train(r, "--model", "cifar10-fast-net", "--batchnorm", "sync", "--devices", "2",
                                   "--steps", "12", *SGD),
        "imagefolder": lambda r: train(r, "--dataset", "imagefolder", "--data-dir", str(shapes), "--devices", "2",
                                       "--steps", "12", "--batch-size", "16", *SGD),
        "torchrun": lambda r: train(r, "--steps", "20", *SGD, "--ema", "0.9", torchrun=True),
        "ddp-clip": lambda r: train(r, "--devices", "2", "--steps", "12", *CLIPPED),
        "fsdp-clip": lambda r: train(r, "--strategy", "fsdp", "--devices", "2", "--steps", "12", *CLIPPED),
        "hsdp-clip": lambda r: train(r, "--strategy", "hsdp", "--shard-size", "2", "--devices", "4",
                                     "--oversubscribe", "--steps", "8", *CLIPPED),
        "gpt-pp": lambda r: train(r, *gpt, "--mesh", "pp=2"),
        "gpt-dp-pp": lambda r: train(r, *gpt, "--mesh", "dp=2,pp=2", "--oversubscribe"),
        "gpt-fsdp-pp": lambda r: train(r, *gpt, "--mesh", "fsdp=2,pp=2", "--oversubscribe"),
        "gpt-dp-tp": lambda r: train(r, *gpt, "--mesh", "dp=2,tp=2", "--oversubscribe"),
        "search": lambda r: cli("search", "--space", str(space), "--sampler", "grid", "--parallel", "2",
                                "--steps", "6", "--out", str(r)),
    }
    if unknown := set(only or ()) - set(runs):
        raise SystemExit(f"--only: no run named {', '.join(sorted(unknown))}; the runs are {', '.join(runs)}")
    left: dict[str, list[Path]] = {}
    for name, run in runs.items():
        if only and name not in only:
            continue
        started = time.perf_counter()
        run(work / name)
        trials = sorted((work / name / "trials").glob("*")) if name == "search" else [work / name]
        left[name] = trials
        print(f"  {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return left


def digest(value: object, h: hashlib._Hash) -> None:
    """Feed a nested structure of tensors and plain values to `h`, in a fixed order."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            h.update(f"K{k!r}".encode())
            digest(value[k], h)
    elif isinstance(value, list | tuple):
        h.update(f"L{len(value)}".encode())
        for v in value:
            digest(v, h)
    else:
        h.update(f"V{value!r}".encode())


def hashed(value: object) -> str:
    h = hashlib.sha256()
    digest(value, h)
    return h.hexdigest()[:16]


def fingerprint(run: Path, work: Path) -> dict[str, str]:
    from paratrain.checkpoint import files as checkpoint

    state = checkpoint.load(run)  # the newest checkpoint: a whole-model file, or a sharded folder read whole
    found = {"weights": hashed(state["model"]), "optimizer": hashed(optimizer_by_name(state)),
             "step": str(state["step"])}
    if "ema_model" in state:
        found["ema"] = hashed(state["ema_model"])
    if (run / "config.yaml").is_file():
        # the work folder's and this checkout's paths out: they differ between runs and checkouts (an imported
        # network is named by its path under examples/)
        text = (run / "config.yaml").read_text().replace(str(work), "WORK").replace(str(REPO), "REPO")
        found["config.yaml"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return found


def optimizer_by_name(state: dict) -> dict:
    """The optimizer's per-parameter state as {parameter name: {key: value}}, whichever form the checkpoint holds
    (a whole-model file numbers the parameters; a sharded checkpoint names them), so that the two forms of one
    run's state hash alike. A file's numbers are named by the model's keys less BatchNorm's buffers (its parameters,
    in order); where they do not count up to the parameters they stay numbers."""
    from paratrain.checkpoint import dcp as sharded

    if "sharded" in state:
        flat = sharded.whole(state["sharded"], ("optimizer",)).get("optimizer", {})
        named: dict[str, dict] = {}
        for key, value in flat.items():  # "state.NAME.momentum_buffer"
            name, _, what = key.removeprefix("state.").rpartition(".")
            named.setdefault(name, {})[what] = value
        return named
    if state.get("optimizer") is None:  # a search trial's kept weights
        return {}
    numbered = state["optimizer"]["state"]
    params = [i for group in state["optimizer"]["param_groups"] for i in group["params"]]
    buffers = ("running_mean", "running_var", "num_batches_tracked")  # BatchNorm's: the buffers a model here has
    names = [k for k in state["model"] if not k.endswith(buffers)]
    if len(names) != len(params):
        return numbered
    return {names[i]: numbered[i] for i in params if i in numbered}


def record(work: Path, only: list[str] | None = None) -> dict[str, dict[str, str]]:
    found = {}
    for name, runs in cases(work, only).items():
        for run in runs:
            key = name if name != "search" else f"search/{_trial_key(run)}"
            found[key] = fingerprint(run, work)
    return found


def _trial_key(run: Path) -> str:
    """A search trial by its point (its number depends on which pool process asked first)."""
    import yaml

    if (run / "config.yaml").is_file():
        cfg = yaml.safe_load((run / "config.yaml").read_text())
    else:
        from paratrain.checkpoint import files as checkpoint

        cfg = checkpoint.load(run, whole=False)["config"]
    return f"lr={cfg['lr']:g},width={cfg['width']}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--save", help="write the hashes to this JSON file")
    p.add_argument("--compare", help="compare with the hashes in this JSON file")
    p.add_argument("--keep", help="run in this folder and keep it (default: a temporary folder)")
    p.add_argument("--only", help="these runs alone, comma-separated (e.g. gpt-pp,fsdp-clip); --compare then "
                                  "compares those")
    p.add_argument("--start-as-before", action="store_true",
                   help="every run starts from the initial weights of releases before the meta-device build "
                        "(benchmarks/start_as_before): its hashes are comparable with theirs")
    args = p.parse_args()
    if args.start_as_before:  # every process the runs start reads the folder's sitecustomize
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "benchmarks" / "start_as_before"), *filter(None, [os.environ.get("PYTHONPATH")])])
    import paratrain

    print(f"paratrain from {Path(paratrain.__file__).parent}", file=sys.stderr)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    with tempfile.TemporaryDirectory(prefix="paratrain-ref-") as tmp:
        work = Path(args.keep or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        found = record(work, args.only.split(",") if args.only else None)
    if args.save:
        Path(args.save).write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    if not args.compare:
        print(json.dumps(found, indent=1, sort_keys=True))
        return 0
    before = json.loads(Path(args.compare).read_text())
    differ = 0
    print(f"{'run':<34}{'what':<12}{'before':<18}{'after':<18}")
    keys = set(found) if args.only else set(before) | set(found)
    for key in sorted(keys):
        old, new = before.get(key, {}), found.get(key, {})
        for what in sorted(set(old) | set(new)):
            same = old.get(what) == new.get(what)
            differ += not same and what in old and what in new
            mark = "" if same else (" DIFFERS" if what in old and what in new else " (only one side)")
            print(f"{key:<34}{what:<12}{old.get(what, '-'):<18}{new.get(what, '-'):<18}{mark}")
    print(f"{differ} difference(s)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
