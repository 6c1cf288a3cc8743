"""What a tracker costs the training loop: summary.json's train_time_s of one run logged to nothing, to the CSV
table, to a local `mlflow server` (SQLite store, loopback, started here) and to W&B offline, a record at every
step (`--log-every 1`, the worst case), interleaved, medians of `--repeats`; run it alone.

MLflow's requests are synchronous (one log_batch per record): the extra time per record is the round trip to the
server, so a remote server costs its latency at each `--log-every`.

    python benchmarks/tracker_overhead.py [--repeats 3] [--steps 200] [--loggers none csv mlflow wandb]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from summaries import trained  # benchmarks/summaries.py, beside this script

FLAGS = ["--model", "lenet5", "--dataset", "digits", "--devices", "1", "--log-every", "1", "--quiet",
         "--no-tensorboard", "--overwrite"]


@contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """`mlflow server` on a free loopback port over a SQLite store in `folder`; its URI."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [shutil.which("mlflow") or str(Path(sys.executable).parent / "mlflow"), "server", "--host",
               "127.0.0.1", "--port", str(port), "--workers", "1", "--backend-store-uri",
               f"sqlite:///{folder / 'store.db'}", "--artifacts-destination", str(folder / "artifacts")]
    # without MLflow's job runner: its 8 huey processes, each importing mlflow, would take cores from the run timed
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(folder / "server.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    said = (folder / "server.log").read_text()[-2000:]
                    raise SystemExit(f"mlflow server did not start: {said}") from None
                time.sleep(0.5)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--loggers", nargs="+", default=["none", "csv", "mlflow", "wandb"])
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in args.loggers}
    with tempfile.TemporaryDirectory() as tmp, mlflow_server(Path(tmp)) as uri:
        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", MLFLOW_TRACKING_URI=uri)
        for _ in range(args.repeats):  # interleaved: the machine's drift falls on every logger alike
            for name in args.loggers:
                summary = trained([*FLAGS, "--steps", str(args.steps), "--logger", name], Path(tmp) / "bench" / name)
                times[name].append(summary["train_time_s"])
    base = statistics.median(times[args.loggers[0]])
    print(f"| --logger | train_time_s (median of {args.repeats}, {args.steps} steps) | against "
          f"{args.loggers[0]} | extra ms per record |")
    print("|---|---|---|---|")
    for name in args.loggers:
        took = statistics.median(times[name])
        print(f"| {name} | {took:.2f} | {took / base:.2f}x | {(took - base) / args.steps * 1000:.1f} |")


if __name__ == "__main__":
    main()
