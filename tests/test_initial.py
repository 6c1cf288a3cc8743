"""A model built on the meta device and its initial weights drawn one module at a time (components/initial.py): the
same weights whatever the order the modules are drawn in and whatever part a worker keeps, so that every layout
starts from one device's weights to the bit; a network that cannot be drawn so is built whole, and says why."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from paratrain.components.build import make_empty
from paratrain.components.initial import Initial, weights_on_meta
from paratrain.config import TrainConfig
from paratrain.data.tensors import tensor_splits
from paratrain.models.gpt import GPT


def _gpt() -> tuple[nn.Module, Initial]:
    with weights_on_meta() as writes:
        model = GPT(64, 16, width=32, depth=2, heads=2)
    initial, why = Initial.of(model, seed=5, why=writes.why)
    assert initial is not None, why
    return model, initial


def test_the_gpt_is_built_without_memory_for_its_weights_and_draws_them_alike_in_any_order() -> None:
    model, initial = _gpt()
    assert all(p.is_meta for p in model.parameters())
    names = [n for n, _ in model.named_parameters()]
    forward = {n: initial.values(n)[n.rpartition(".")[2]] for n in names}
    backward = {n: initial.values(n)[n.rpartition(".")[2]] for n in reversed(names)}
    assert all(torch.equal(forward[n], backward[n]) for n in names)
    whole = initial.fill(model, torch.device("cpu"))
    assert all(torch.equal(p, forward[n]) for n, p in whole.named_parameters())
    # GPT-2's initialisation: N(0, 0.02^2), a residual branch's last layer 1/sqrt(2 x depth) of that
    assert abs(forward["1.attention.query.weight"].std().item() - 0.02) < 2e-3
    assert abs(forward["1.mlp.down.weight"].std().item() - 0.01) < 1e-3
    _, other = _gpt()
    other.seed = 6
    assert not torch.equal(other.values("1.mlp.up.weight")["weight"], forward["1.mlp.up.weight"])


def test_buffers_are_kept_as_built_and_a_network_that_cannot_draw_its_weights_says_why() -> None:
    with weights_on_meta() as writes:
        net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    initial, _ = Initial.of(net, 0, writes.why)
    filled = initial.fill(net, torch.device("cpu"))
    assert torch.equal(filled[1].running_var, torch.ones(4)) and not filled[0].weight.is_meta

    class Scale(nn.Module):
        def __init__(self, values: bool) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3) if values else torch.empty(3))

    with weights_on_meta() as writes:
        own = nn.Sequential(nn.Linear(3, 3), Scale(values=False))
    assert Initial.of(own, 0, writes.why) == (None, "its module '1' (Scale) holds weights and has no "
                                                       "reset_parameters to draw them")
    with weights_on_meta() as writes:
        own = nn.Sequential(nn.Linear(3, 3), Scale(values=True))
    assert Initial.of(own, 0, writes.why) == (None, "its Scale registers a weight 'gain' with values of its own")
    with weights_on_meta() as writes:  # an initialisation of its own, as torchvision's ResNet makes in its constructor
        own = nn.Sequential(nn.Linear(3, 3))
        nn.init.kaiming_normal_(own[0].weight, mode="fan_out")
    assert "sets its weights' values itself" in Initial.of(own, 0, writes.why)[1]
    with weights_on_meta() as writes:  # a weight two layers share (a tied head) stays one weight, drawn once
        tied = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
        tied[1].weight = tied[0].weight
    filled = Initial.of(tied, 0, writes.why)[0].fill(tied, torch.device("cpu"))
    assert filled[1].weight is filled[0].weight and filled[0].weight.std() > 0.5  # (nn.Embedding's N(0, 1))
    saved = nn.Linear(3, 3).state_dict()
    with weights_on_meta() as writes:
        loading = nn.Linear(3, 3)
        loading.load_state_dict(saved)
    initial, why = Initial.of(loading, 0, writes.why)
    assert initial is None and "loads them" in why


def test_a_network_that_cannot_be_drawn_is_built_whole_from_the_seed_as_before(tmp_path: Path) -> None:
    from paratrain.components.parts import Parts

    def factory(num_classes: int | None = None, **_: object) -> nn.Module:
        net = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
        net[1].weight.data.copy_(torch.arange(12.0).reshape(3, 4))  # weights of its own
        return net

    pair = (torch.randn(20, 4), torch.randint(0, 3, (20,)))
    data = tensor_splits({"train": pair, "val": pair, "test": pair})
    cfg = TrainConfig(seed=3)
    model, initial, why = make_empty(cfg, data, Parts(factory))
    assert initial is None and "loads them" in why
    assert torch.equal(model[1].weight, torch.arange(12.0).reshape(3, 4))


# ---- every worker's part of every weight: the same as one device's, to the bit (2 and 4 CPU workers) ----

def _worker(rank: int, world: int, port: int, layout: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from paratrain.parallel.strategies.tensor_plan import apply, plan_of

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, initial = _gpt()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("fsdp", "tp"))
        model = apply(model, mesh["tp"], plan_of(model, None))
    if "fsdp" in layout:
        for block in list(model)[:-1]:
            fully_shard(block, mesh=mesh["fsdp"])
        fully_shard(model, mesh=mesh["fsdp"])
    initial.fill(model, torch.device("cpu"))
    whole = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(whole, out)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
@pytest.mark.parametrize(("layout", "world"), [("fsdp x tp", 4)])  # (fsdp alone: tests/test_pretrained.py's start)
def test_each_worker_draws_its_part_of_one_devices_initial_weights(tmp_path: Path, layout: str, world: int) -> None:
    model, initial = _gpt()
    one = {n: p.detach().clone() for n, p in initial.fill(model, torch.device("cpu")).named_parameters()}
    out = tmp_path / "whole.pt"
    mp.start_processes(_worker, args=(world, _free_port(), layout, str(out)), nprocs=world, start_method="fork")
    whole = torch.load(out)
    assert whole.keys() == one.keys()
    assert all(torch.equal(whole[n], one[n]) for n in one)
