"""What rank 0 writes into a run directory: metrics.jsonl, summary.json, and the console lines."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tqdm import tqdm


class RunLog:
    """JSON-lines metrics and an optional progress bar; every method is a no-op off rank 0."""

    def __init__(self, run_dir: Path, active: bool, quiet: bool, total_steps: int, start_step: int) -> None:
        self.active = active
        self.quiet = quiet
        self.path = run_dir / "metrics.jsonl"
        self.bar = None
        if not active:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        self.file = open(self.path, "a")  # noqa: SIM115 (closed in close())
        if not quiet:
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            mininterval=0.5)

    def _truncate_after(self, step: int) -> None:
        """On resume, drop the records a killed run wrote after its last checkpoint."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def record(self, **fields: Any) -> None:
        if self.active:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in fields.items()}
            self.file.write(json.dumps(clean) + "\n")
            self.file.flush()

    def advance(self, steps: int = 1, **postfix: float) -> None:
        if self.bar is not None:
            self.bar.update(steps)
            if postfix:
                self.bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)

    def say(self, line: str) -> None:
        """A console line that does not break the progress bar."""
        if self.active and not self.quiet:
            tqdm.write(line)

    def close(self) -> None:
        if self.active:
            if self.bar is not None:
                self.bar.close()
            self.file.close()


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
