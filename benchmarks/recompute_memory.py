"""Peak memory with and without activation checkpointing, against the batch and the context: the gpt of depth 4
and width 256, one worker of one thread, 3 AdamW steps, each run a process of its own. summary.json's
peak_memory_bytes (the process's peak resident memory) and peak_memory_added_bytes (what the steps added to the
memory they started from; torch's libraries alone hold about 0.5 GB), and the training rate.

    python benchmarks/recompute_memory.py --text FILE [--batches 16 32] [--contexts 128 256]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from summaries import trained  # benchmarks/summaries.py, beside this script


def run(text: str, batch: int, context: int, mode: str, out: Path) -> dict:
    flags = ["--dataset", "text", "--data-dir", text, "--model", "gpt", "--width", "256", "--depth", "4",
             "--context", str(context), "--batch-size", str(batch), "--steps", "3", "--optimizer", "adamw",
             "--devices", "1", "--threads-per-worker", "1", "--activation-checkpointing", mode, "--quiet",
             "--no-tensorboard", "--overwrite"]
    return trained(flags, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", required=True, help="a UTF-8 text file")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 256])
    args = parser.parse_args()
    mb = 2**20
    print("| batch | context | peak MB, kept | peak MB, recomputed | ratio | added MB, kept | added MB, recomputed "
          "| ratio | tokens/s, kept | tokens/s, recomputed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batches:
            for context in args.contexts:
                kept, again = (run(args.text, batch, context, mode, Path(tmp) / "run") for mode in ("none", "full"))
                peak = [s["peak_memory_bytes"][0] / mb for s in (kept, again)]
                added = [s["peak_memory_added_bytes"][0] / mb for s in (kept, again)]
                rate = [s["tokens_per_sec"] for s in (kept, again)]
                print(f"| {batch} | {context} | {peak[0]:,.0f} | {peak[1]:,.0f} | {peak[1] / peak[0]:.2f}x | "
                      f"{added[0]:,.0f} | {added[1]:,.0f} | {added[1] / added[0]:.2f}x | {rate[0]:,.0f} | "
                      f"{rate[1]:,.0f} |")


if __name__ == "__main__":
    main()
