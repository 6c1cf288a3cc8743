"""The run folder's paths: the one place that names what a run keeps in its folder, for the code that writes it
and the code that reads it back (a resume, eval, export, paratrain log, bench, a search's trials). No torch.

    config.yaml        the resolved options (session)           summary.json   the run's figures (its end)
    parts.yaml         the network, optimizer, loss of your own  metrics.jsonl  a record per logged step/epoch
    checkpoints/       a step's checkpoint each                   tb/            TensorBoard's events
    metrics.csv        --logger csv                               trackers.json  MLflow's and W&B's runs of it
    wandb/             W&B's own files                            data-cache/    a Dataset's images, decoded once
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    """The paths of the run folder `root`."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def parts(self) -> Path:
        return self.root / "parts.yaml"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def metrics_csv(self) -> Path:
        return self.root / "metrics.csv"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tb"

    @property
    def trackers(self) -> Path:
        return self.root / "trackers.json"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    @property
    def data_cache(self) -> Path:
        """A torch Dataset's images, decoded once for the run (paratrain.fit); kept by --overwrite, a cache."""
        return self.root / "data-cache"

    def written(self) -> tuple[Path, ...]:
        """Everything a run writes here: what --overwrite removes, and nothing else."""
        return (self.config, self.parts, self.summary, self.metrics, self.checkpoints, self.tensorboard,
                self.metrics_csv, self.trackers, self.wandb)

    def written_into(self) -> tuple[tuple[Path, bool], ...]:
        """What a run writes into rather than replaces (its folders, True; its appended log, False): a link or
        the other kind of file there would be written through."""
        return (self.checkpoints, True), (self.tensorboard, True), (self.metrics, False)
