"""The genetic network search against a grid given the same wall time, on real MNIST and CIFAR-10, and a
search whose trials are hybrids (2 stages x 2 copies); prints a table per search from its outputs.

    python benchmarks/search_results.py --data-dir ../shared/data [--only mnist|cifar10|hybrid|mnist-long] \
        [--mnist-minutes 45] [--cifar-minutes 30] [--long-minutes 45] [--cifar-grid] [--out search-results]

Each genetic search is the classic one (MLPs, population 20 x 10 generations, dropout 0.2), every trial
trained for at most an epoch cap with early stopping and the median pruner (MNIST: 6 epochs, patience 2;
CIFAR-10: 10 and 3; mnist-long: 20 and the published patience 5); the fitness is the validation accuracy
and the winner's test accuracy is the figure to compare with the published one (MNIST > 0.98, CIFAR-10 0.56).
A --time-budget caps each genetic search (a generation cut short is reported as such); the grid then gets
the genetic search's own wall time (on CIFAR-10 only with --cifar-grid). Run it alone on the machine: it is
a timing. Searches already finished in --out are read, not run again (delete a folder to run it anew).
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

import yaml

TRIAL = ["--pruner", "median", "--dropout", "0.2", "--batch-size", "256"]


def search(out: Path, *flags: str) -> dict:
    """Run `paratrain search` into out (or read the one already there) and return its summary."""
    if not (out / "summary.yaml").exists():
        command = [sys.executable, "-m", "paratrain", "search", *flags, "--out", str(out)]
        print("$", " ".join(command[1:]), flush=True)
        subprocess.run(command, check=True)
    summary = yaml.safe_load((out / "summary.yaml").read_text())
    with open(out / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    trained = [r for r in rows if r["state"] in ("COMPLETE", "PRUNED") and not r["reused"]]
    generations = {r["generation"] for r in trained if r["generation"] not in ("", None)}
    return {**summary, "trained": len(trained), "generations": len(generations) or None}


def table(rows: list[tuple[str, dict]]) -> None:
    print(f"\n{'search':<34}{'wall s':>8}{'trained':>9}{'pruned':>8}{'reused':>8}{'failed':>8}{'gens':>6}"
          f"{'best val':>10}{'its test':>10}")
    for name, s in rows:
        print(f"{name:<34}{s['wall_time_s']:>8.0f}{s['trained']:>9}{s['pruned']:>8}{s['reused']:>8}{s['failed']:>8}"
              f"{s['generations'] or '-':>6}{s['best_val_accuracy']:>10.4f}{s['best_test_accuracy']:>10.4f}")
    print(flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True, help="the folder holding mnist/ and cifar-10-batches-bin/")
    p.add_argument("--only", choices=["mnist", "cifar10", "hybrid", "mnist-long"],
                   help="one search (default: all but mnist-long)")
    p.add_argument("--mnist-minutes", type=float, default=45)
    p.add_argument("--cifar-minutes", type=float, default=30)
    p.add_argument("--long-minutes", type=float, default=45, help="mnist-long: 20 epochs, patience 5")
    p.add_argument("--cifar-grid", action="store_true", help="run the grid of the same wall time on CIFAR-10 too")
    p.add_argument("--out", default="search-results")
    args = p.parse_args()
    root, out = Path(args.data_dir), Path(args.out)
    if args.only in (None, "hybrid"):
        hybrid = out / "hybrid-mnist"
        s = search(hybrid, "--space", "mlp-mnist", "--sampler", "genetic", "--population", "4", "--generations", "2",
                   "--strategy", "hybrid", "--stages", "2", "--devices-per-trial", "4", "--parallel", "1",
                   "--oversubscribe", "--data-dir", str(root / "mnist"), "--epochs", "1", "--batch-size", "256")
        again = out / "hybrid-best-again"
        command = [sys.executable, "-m", "paratrain", "train", "--config", str(hybrid / "best.yaml"),
                   "--quiet", "--overwrite", "--no-tensorboard", "--out", str(again)]
        print("$", " ".join(command[1:]), flush=True)
        subprocess.run(command, check=True)
        rerun = yaml.safe_load((again / "summary.json").read_text())
        table([("hybrid 2x2, genetic 4 x 2, MNIST", s)])
        print(f"best.yaml trained again: val accuracy {rerun['val_accuracy']:.4f} (the search's "
              f"{s['best_val_accuracy']:.4f}), test accuracy {rerun['test_accuracy']:.4f} (the search's "
              f"{s['best_test_accuracy']:.4f})\n", flush=True)
    searches = (  # (name, dataset, its folder, minutes, epoch cap, patience, grid beside it)
        ("mnist", "mnist", "mnist", args.mnist_minutes, 6, 2, True),
        ("cifar10", "cifar10", "cifar-10-batches-bin", args.cifar_minutes, 10, 3, args.cifar_grid),
        ("mnist-long", "mnist", "mnist", args.long_minutes, 20, 5, False))  # the published patience
    for name, dataset, folder, minutes, epochs, patience, with_grid in searches:
        if args.only != name and not (args.only is None and name != "mnist-long"):
            continue
        common = ["--space", "mlp-mnist", "--dataset", dataset, "--data-dir", str(root / folder), *TRIAL,
                  "--epochs", str(epochs), "--early-stopping", str(patience)]
        ga = search(out / f"genetic-{name}", *common, "--sampler", "genetic", "--population", "20",
                    "--generations", "10", "--time-budget", str(int(minutes * 60)))
        rows = [(f"genetic 20 x 10, {name}", ga)]
        if with_grid:
            rows.append((f"grid, same wall time, {name}", search(out / f"grid-{name}", *common, "--sampler", "grid",
                                                                 "--time-budget", str(int(ga["wall_time_s"])))))
        print(f"each trial: at most {epochs} epochs, early stopping after {patience} without a lower validation "
              f"loss, the median pruner, dropout 0.2, batch 256")
        table(rows)


if __name__ == "__main__":
    main()
