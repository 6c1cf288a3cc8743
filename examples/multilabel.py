"""Multi-label classification: 16 features an example, 4 labels each 0 or 1 (any number of them on), binary
cross-entropy on the logits, a torchmetrics F1 over the labels.

    python examples/multilabel.py            # 2 workers, then 1 device, on the same global batch

`make_data` builds the table (deterministic): label k is on where the features lie on one side of the k-th
of 4 random hyperplanes. The targets are rows of 0/1 floats, so no accuracy is reported; the loss is the
caller's (BCE on logits), and the F1 is computed over every worker's examples as over one device's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LABELS = 4


def make_data(n: int = 3000, features: int = 16, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, LABELS, generator=g) > 0).float()
    a, b = int(n * 0.8), int(n * 0.9)
    return {"train": (x[:a], y[:a]), "val": (x[a:b], y[a:b]), "test": (x[b:], y[b:])}


def build(input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    return nn.Sequential(nn.Linear(input_shape[0], 64), nn.ReLU(), nn.Linear(64, num_outputs))  # a logit per label


if __name__ == "__main__":
    import torchmetrics
    from torchmetrics.wrappers import LambdaInputTransformer

    import paratrain

    data = make_data()
    for devices in ("2", "1"):
        # torchmetrics takes a batch as logits only where some value is outside 0..1, so the value would
        # depend on the batches: it is given probabilities
        f1 = LambdaInputTransformer(torchmetrics.F1Score(task="multilabel", num_labels=LABELS),
                                    transform_pred=torch.sigmoid)
        summary = paratrain.fit(build, data, paratrain.TrainConfig(devices=devices, steps=300, batch_size=64,
                                                                   optimizer="adam", lr=0.003,
                                                                   out=f"runs/multilabel-{devices}"),
                                loss=F.binary_cross_entropy_with_logits, metrics={"f1": f1})
        print(f"{devices} device(s): test F1 {summary['test_f1']:.4f}")
