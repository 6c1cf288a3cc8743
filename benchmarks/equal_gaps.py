"""How far a layout ends from one device as the training moves faster or longer (issue "Fine-tuning a language
model"'s second-day point): the gpt on the tests' corpus (bytes, context 64, width 64, 4 heads, batch 16, dropout
0), from one setting, the defaults (AdamW at lr 2e-3, depth 4, 20 steps), one thing changed at a time: the
learning rate (1e-4, 1e-3), the depth (2), the steps (60), the optimizer (SGD with momentum, lr 0.05). For each,
ddp on 2 workers, tp=2, pp=2 (a 2-stage pipeline) and dp=2,tp=2,pp=2 (8 workers: --oversubscribe on few cores)
against one device: the largest difference over the weights and the difference of the validation losses.

    python benchmarks/equal_gaps.py [--layouts ddp,tp,pp,3d] [--settings default,lr1e-4,...]

Each run is `paratrain train` in a fresh process with 1 thread a worker, the same seed, data and global batch.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from paratrain.checkpoint import files as checkpoint

REPO = Path(__file__).resolve().parents[1]
BASE = ["--model", "gpt", "--dataset", "text", "--context", "64", "--width", "64", "--heads", "4",
        "--batch-size", "16", "--dropout", "0", "--seed", "9", "--threads-per-worker", "1", "--no-tensorboard",
        "--quiet", "--eval-batch-size", "64"]
DEFAULT = {"--optimizer": "adamw", "--lr": "2e-3", "--depth": "4", "--steps": "20"}
SETTINGS = {"default": {}, "lr1e-4": {"--lr": "1e-4"}, "lr1e-3": {"--lr": "1e-3"}, "depth2": {"--depth": "2"},
            "steps60": {"--steps": "60"}, "sgd": {"--optimizer": "sgd", "--lr": "0.05", "--momentum": "0.9"}}
LAYOUTS = {"ddp": ["--devices", "2"], "tp": ["--mesh", "tp=2"], "pp": ["--mesh", "pp=2"],
           "3d": ["--mesh", "dp=2,tp=2,pp=2", "--oversubscribe"]}


def run(out: Path, corpus: Path, setting: dict[str, str], layout: list[str]) -> tuple[dict, dict]:
    flags = [x for k, v in {**DEFAULT, **setting}.items() for x in (k, v)]
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", *BASE, "--data-dir", str(corpus), *flags,
                           *layout, "--out", str(out)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{out.name}: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads((out / "summary.json").read_text()), checkpoint.load(out)["model"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_bytes(gzip.decompress((REPO / "tests" / "data" / "corpus.txt.gz").read_bytes()))
        print(f"{'setting':<9}{'layout':<7}{'weights':>10}{'val loss':>10}")
        for name in args.settings.split(","):
            one, base = run(Path(tmp) / f"{name}-1", corpus, SETTINGS[name], ["--devices", "1"])
            for layout in args.layouts.split(","):
                summary, weights = run(Path(tmp) / f"{name}-{layout}", corpus, SETTINGS[name], LAYOUTS[layout])
                gap = max(float((weights[k].double() - base[k].double()).abs().max()) for k in base)
                print(f"{name:<9}{layout:<7}{gap:>10.1e}{abs(summary['val_loss'] - one['val_loss']):>10.1e}",
                      flush=True)


if __name__ == "__main__":
    main()
