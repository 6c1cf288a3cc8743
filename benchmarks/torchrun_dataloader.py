"""The way most DDP tutorials train: torchrun + DistributedSampler + DataLoader + per-sample transforms.

One of the two rows of benchmarks/ddp_vs_dataloader.py (started there by torchrun; not a paratrain path).
Prints rank 0's examples/sec (whole global batch, warm-up excluded) as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms

from paratrain.data import load_dataset
from paratrain.models import build_model

WARMUP = 10


class PilMnist(torch.utils.data.Dataset):
    """What torchvision.datasets.MNIST.__getitem__ does: a PIL image per sample, then the transforms."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform) -> None:  # noqa: ANN001
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):  # noqa: ANN204
        from PIL import Image

        return self.transform(Image.fromarray(self.images[i, 0].numpy(), mode="L")), int(self.labels[i])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--batch-size", type=int, default=512, help="global batch")
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # 2 processes on 2 cores
    x, y = load_dataset("mnist", args.data_dir, download=False).train
    tf = transforms.Compose([transforms.Pad(2), transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    data = PilMnist(x, y, tf)
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size // world, sampler=sampler, drop_last=True)
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model("lenet5", 1, 32, 10))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    done, t0, epoch = 0, 0.0, 0
    while done < WARMUP + args.steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            if done == WARMUP:
                t0 = time.perf_counter()
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if done == WARMUP + args.steps:
                break
        epoch += 1
    rate = args.steps * args.batch_size / (time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"examples_per_sec": rate}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
