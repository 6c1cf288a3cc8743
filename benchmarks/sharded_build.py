"""What a sharded layout's worker holds at its peak, against one device (issue "Models bigger than one worker"): the
gpt of ~150M weights (width 1024, depth 12, byte vocabulary, context 64, batch 8), AdamW, 2 steps, on the fixed
corpus of tests/data, as one device (without and with --ema), 4 fsdp workers, --mesh fsdp=2,tp=2 and 4 fsdp
workers with --ema, the last against one device with --ema (4 workers on 2 cores: --oversubscribe; memory, not
speed, is measured).

    python benchmarks/sharded_build.py [--width 1024] [--depth 12] [--layouts 1,1+ema,fsdp:4,fsdp=2.tp=2,fsdp:4+ema]

For each run, the worst worker's model state (parameters, gradients, AdamW's moments), its process's peak resident
set (summary.json's peak_memory_bytes), that peak less what it held as it began building the model
(peak_memory_added_bytes: torch's libraries and the data are in both) and the ratio of that to one device's. A
quarter of one device's state is 0.25x; a worker that builds the whole model before sharding it adds the whole
model to its peak. Last, what `paratrain plan` predicts of that worker's peak from one device's measured bytes
(measure/meshes.py: the state a weight, the rest of the peak an example, fsdp's gathered blocks) and its error.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MB = 1e6
LAYOUTS = {"1": ["--devices", "1"],
           "1+ema": ["--devices", "1", "--ema", "0.99"],
           "fsdp:4": ["--strategy", "fsdp", "--devices", "4", "--oversubscribe"],
           "fsdp=2.tp=2": ["--mesh", "fsdp=2,tp=2", "--oversubscribe"],
           "fsdp:4+ema": ["--strategy", "fsdp", "--devices", "4", "--oversubscribe", "--ema", "0.99"]}


def flags(corpus: Path, width: int, depth: int) -> list[str]:
    return ["--model", "gpt", "--dataset", "text", "--data-dir", str(corpus), "--width", str(width),
            "--depth", str(depth), "--heads", str(max(2, width // 64)), "--context", "64", "--batch-size", "8",
            "--optimizer", "adamw", "--steps", "2", "--eval-batch-size", "8",
            "--threads-per-worker", "1", "--no-tensorboard", "--quiet", "--log-every", "1"]


def run(name: str, args: list[str], scratch: Path) -> dict | None:
    out = scratch / name.replace(":", "-").replace("=", "").replace("+", "-")
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", "--out", str(out), *args, *LAYOUTS[name]],
                          capture_output=True, text=True)
    if proc.returncode:
        print(f"{name:<14} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}")
        return None
    return json.loads((out / "summary.json").read_text())


def plan_model(common: list[str]) -> object | None:
    """The gpt as `paratrain plan` reads a bench of it (measure/meshes.of_bench, from the same flags); None from a
    release whose plan counted no peak (before 2026-12-01)."""
    try:
        from paratrain.measure import meshes
        meshes.measured_bytes  # noqa: B018 (a release of before has none)
    except (ImportError, AttributeError):
        return None
    return meshes.of_bench({"train_flags": common})


def plan_peak(name: str, one: dict, model: object) -> float:
    """`paratrain plan`'s bytes of the worst worker of layout `name`, from the 1-device run's summary as the bench
    records it (its largest state and peak added)."""
    from paratrain.measure import meshes
    from paratrain.parallel.mesh import Mesh

    base = {"model_state_bytes": max(w["total"] for w in one["model_state_bytes"]),
            "peak_memory_added_bytes": max(one["peak_memory_added_bytes"]),
            "global_batch_size": one["global_batch_size"]}
    held = dataclasses.replace(meshes.measured_bytes({"train_flags": []}, base, model), ema="ema" in name)
    mesh = {"1": Mesh(), "fsdp:4": Mesh(fsdp=4), "fsdp=2.tp=2": Mesh(fsdp=2, tp=2)}[name.split("+")[0]]
    return held.peak(model, mesh, one["global_batch_size"])["peak_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        corpus = scratch / "corpus.txt"
        text = gzip.decompress((REPO / "tests" / "data" / "corpus.txt.gz").read_bytes())
        corpus.write_bytes(text[:20_000])  # its evaluations short
        common = flags(corpus, args.width, args.depth)
        print(f"gpt width {args.width}, depth {args.depth}, AdamW, 2 steps: the worst worker")
        print(f"{'layout':<14}{'weights':>13}{'state MB':>10}{'peak MB':>9}{'peak added MB':>15}{'x 1 device':>12}"
              f"{'plan MB':>9}{'error':>8}")
        ones, model = {}, plan_model(common)  # one device's runs: without and with --ema
        for name in args.layouts.split(","):
            summary = run(name, common, scratch)
            if summary is None:
                continue
            worst = max(summary["peak_memory_added_bytes"])
            state = max(w["total"] for w in summary["model_state_bytes"])
            if name.split("+")[0] == "1":
                ones[name] = summary
            one = ones.get("1")  # the plan counts from one device without the average, as a bench runs it
            # (a layout with the average against one device with it, where that ran)
            like = ones.get("1+ema", one) if name.endswith("+ema") else one
            base = max(like["peak_memory_added_bytes"]) if like else 0
            ratio = f"{worst / base:.2f}" if base > 0 else "-"
            planned = plan_peak(name, one, model) if one and model else None
            guess = (f"{planned / MB:>9.0f}{planned / worst - 1:>+8.0%}" if planned and worst > 0
                     else f"{'-':>9}{'-':>8}")
            weights = sum(w["parameters"] for w in summary["model_state_bytes"]) // 4  # each worker its part
            peak = max(summary["peak_memory_bytes"])
            print(f"{name:<14}{weights:>13,}{state / MB:>10.0f}{peak / MB:>9.0f}{worst / MB:>15.0f}{ratio:>12}"
                  f"{guess}", flush=True)


if __name__ == "__main__":
    main()
