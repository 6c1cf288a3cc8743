"""The gpt's training rate: paratrain against a plain PyTorch loop of the same model, and --compile's speed-up
under each strategy, in tokens/s (summary.json's, which leaves evaluation and compiling out).

    python benchmarks/gpt_speed.py --text FILE [--repeats 3] [--steps 40] [--only plain|compile]

plain:   one process of all the cores' threads; the same GPT (models/gpt.py), the same byte windows as in-memory
         tensors, AdamW, random batches: the loop as users write it, timed after 5 warm-up steps; against
         `paratrain train --devices 1` (the median of its logged 5-step windows after the first).
compile: `paratrain train` eager and with --compile under ddp on 1 and 2 workers, fsdp, tp and a 2-stage
         pipeline (2 workers each); compile_s is the time the steps spent compiling.
Interleaved, medians of --repeats; run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from summaries import trained  # benchmarks/summaries.py, beside this script

SHAPE = {"width": 128, "depth": 4, "heads": 2, "context": 128, "batch": 16}


def plain_loop(text: str, steps: int) -> float:
    """Tokens/s of the plain loop."""
    import torch
    import torch.nn.functional as F

    from paratrain.models.gpt import GPT
    from paratrain.runtime.proc import tune_malloc

    tune_malloc()
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    c = SHAPE["context"]
    raw = torch.tensor(list(Path(text).read_bytes()), dtype=torch.long)
    windows = raw[:(len(raw) - 1) // (c + 1) * (c + 1)].view(-1, c + 1)
    model = GPT(256, c, SHAPE["width"], SHAPE["depth"], SHAPE["heads"], dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warmup = 5
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        batch = windows[torch.randint(len(windows), (SHAPE["batch"],))]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return steps * SHAPE["batch"] * c / (time.perf_counter() - start)


def paratrain_run(text: str, steps: int, layout: list[str], out: Path) -> dict:
    flags = ["--dataset", "text", "--data-dir", text, "--model", "gpt", "--optimizer", "adamw",
             "--width", str(SHAPE["width"]), "--depth", str(SHAPE["depth"]), "--heads", str(SHAPE["heads"]),
             "--context", str(SHAPE["context"]), "--batch-size", str(SHAPE["batch"]), "--steps", str(steps),
             "--quiet", "--no-tensorboard", "--overwrite", *layout]
    return trained(flags, out)


def plain(args: argparse.Namespace, tmp: Path) -> None:
    rates: dict[str, list[float]] = {"plain loop": [], "paratrain --devices 1": []}
    for _ in range(args.repeats):
        code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import gpt_speed; " \
               f"print(gpt_speed.plain_loop({args.text!r}, {args.steps}))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        rates["plain loop"].append(float(done.stdout.split()[-1]))
        paratrain_run(args.text, args.steps + 5, ["--devices", "1", "--log-every", "5"], tmp / "run")
        records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
        windows = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r][1:]  # the first 5: warm-up
        rates["paratrain --devices 1"].append(statistics.median(windows))
    base = statistics.median(rates["plain loop"])
    print(f"| run | tokens/s (median of {args.repeats}) | against the plain loop |")
    print("|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):,.0f} | {statistics.median(values) / base:.2f}x |")


LAYOUTS = {"ddp, 1 worker": ["--devices", "1"], "ddp, 2 workers": ["--devices", "2"],
           "fsdp, 2 workers": ["--strategy", "fsdp", "--devices", "2"],
           "tp, 2 workers": ["--strategy", "tp", "--devices", "2"],
           "pipeline, 2 stages": ["--strategy", "pipeline", "--stages", "2", "--devices", "2"]}


def compiled(args: argparse.Namespace, tmp: Path) -> None:
    found: dict[tuple[str, bool], list[dict]] = {(n, c): [] for n in LAYOUTS for c in (False, True)}
    for _ in range(args.repeats):
        for (name, on) in found:
            layout = [*LAYOUTS[name], *(["--compile"] if on else [])]
            found[(name, on)].append(paratrain_run(args.text, args.steps, layout, tmp / "run"))
    print(f"| layout | eager tokens/s | compiled tokens/s | speed-up | compile_s (medians of {args.repeats}) |")
    print("|---|---|---|---|---|")
    for name in LAYOUTS:
        eager = statistics.median(s["tokens_per_sec"] for s in found[(name, False)])
        fast = statistics.median(s["tokens_per_sec"] for s in found[(name, True)])
        spent = statistics.median(s["compile_s"] for s in found[(name, True)])
        print(f"| {name} | {eager:,.0f} | {fast:,.0f} | {fast / eager:.2f}x | {spent:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", required=True, help="a UTF-8 text file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--only", choices=("plain", "compile"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "plain"):
            plain(args, Path(tmp))
        if args.only in (None, "compile"):
            compiled(args, Path(tmp))


if __name__ == "__main__":
    main()
