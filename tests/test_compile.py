"""--compile under every strategy (Strategy.compile): what each compiles (the whole model under ddp, each block
where fsdp or tensor parallelism shards it, a pipeline's stage), the names and hooks left as they were, the
tower's refusal; on 2 CPU workers the gpt compiled under fsdp, tp and a 2-stage pipeline ends within 1e-4 of the
same run uncompiled, says nothing on the way or at its exit, and reports its compile time apart from its rate
(the rate of the steps after the first 2, which compile)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import max_abs_diff, run_cli, weights

from paratrain import config
from paratrain.core.errors import UserError
from paratrain.parallel.strategies import checked


def test_the_tower_refuses_compile_in_one_line_and_the_other_strategies_take_it() -> None:
    with pytest.raises(UserError, match="--compile is not available with --strategy tower .*use --strategy ddp"):
        checked(config.validate(config.TrainConfig(compile=True, strategy="tower")))
    for values in ({"strategy": "ddp"}, {"strategy": "fsdp"}, {"strategy": "hsdp"}, {"strategy": "tp"},
                   {"strategy": "pipeline", "stages": 2}, {"strategy": "hybrid", "stages": 2},
                   {"strategy": "tp", "mesh": "fsdp=2,tp=2"}):
        checked(config.validate(config.TrainConfig(compile=True, **values)))


def test_dropout_of_the_global_batch_compiles_into_one_graph_with_one_devices_masks() -> None:
    """The gpt with dropout 0.1 (5 dropout calls a forward), compiled within the masks of worker 1 of 2: one graph
    for three micro-batches of three seeds (its generator made in the traced code broke the graph at every call
    and its seed was a guard: 13 graphs), no graph break, and the outputs those of the same masks uncompiled,
    bit for bit."""
    from torch._dynamo.utils import counters

    from paratrain.features.dropout import GlobalBatchDropout, mixed_seed
    from paratrain.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(256, 16, width=32, depth=2, heads=2, dropout=0.1).train()
    graphs: list = []
    compiled = torch.compile(model, backend=lambda graph, inputs: graphs.append(graph) or graph.forward)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    counters.clear()
    for step in range(3):
        seed = mixed_seed(7, step, 0)
        with GlobalBatchDropout(torch.device("cpu"), (1, 2), 4, seed, 1) as eager:
            want = model(ids)
        with GlobalBatchDropout(torch.device("cpu"), (1, 2), 4, seed, 1) as traced:
            got = compiled(ids)
        assert torch.equal(got, want) and traced.placed == eager.placed == 5, step
    assert len(graphs) == 1 and not counters["graph_break"], (len(graphs), dict(counters["graph_break"]))


def test_blocks_compiled_each_on_its_own_share_one_graph_whatever_their_place_and_a_pipelines_chunk() -> None:
    """fsdp's and tp's units: each block of the gpt compiled on its own (one code, four blocks), within the masks of
    worker 1 of 2, then of a pipeline's chunks (placed at other shares and calls): one graph for every block,
    chunk and seed (the call's number, a Python number, was a constant guarded: a graph per block, and past 8
    blocks torch ran them uncompiled), and the outputs those of the same masks uncompiled, bit for bit."""
    from torch._dynamo.utils import counters

    from paratrain.features.dropout import GlobalBatchDropout, mixed_seed
    from paratrain.models.gpt import GPT, Block

    torch.manual_seed(0)
    model = GPT(256, 16, width=32, depth=4, heads=2, dropout=0.1).train()
    blocks = [m for m in model if isinstance(m, Block)]
    graphs: list = []
    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))

    def backend(graph: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    eager = [Block.forward.__get__(block) for block in blocks]  # as fsdp compiles its units: each forward in place
    compiled_forwards = [torch.compile(forward, backend=backend) for forward in eager]

    def run(compiled: bool, seed: int, place: tuple[int, int, int] | None) -> tuple[torch.Tensor, int]:
        for block, forward in zip(blocks, compiled_forwards if compiled else eager, strict=True):
            block.forward = forward
        with GlobalBatchDropout(torch.device("cpu"), (1, 2), 4, seed, 1) as mode:
            if place is not None:
                mode.place(*place)
            return model(ids), mode.placed

    for step, place in enumerate([None, None, (3, 8, 0), (5, 8, 40)]):
        want, got = run(False, mixed_seed(7, step, 0), place), run(True, mixed_seed(7, step, 0), place)
        assert torch.equal(got[0], want[0]) and got[1] == want[1] == 4 * 2 + 1, step  # two a block, one at the start
    assert len(graphs) == 1 and not counters["graph_break"], (len(graphs), dict(counters["graph_break"]))


def test_fsdp_compiles_each_sharded_block_in_place_and_keeps_the_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward of each unit is compiled in place (an attribute of the unit: its hooks, where fsdp gathers a
    block's weights, run around it); the module and its parameters' names are as they were. Whole copies (ddp)
    and one worker compile the whole model."""
    from paratrain.parallel import strategies
    from paratrain.parallel.layout import Layout
    from paratrain.parallel.mesh import Mesh

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn: compiled.append(fn) or fn)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    names = [n for n, _ in model.named_parameters()]

    def strategy(name: str, mesh: Mesh) -> Any:
        ctx = type("Ctx", (), {"distributed": mesh.workers > 1})()
        made = strategies.get(name)(ctx, config.TrainConfig(strategy=name), Layout(name, mesh))
        made.module = model
        return made

    sharded = strategy("fsdp", Mesh(fsdp=2))
    assert sharded.compiled_units() == [model[0], model[2]]  # the blocks with weights, not the root
    sharded.compile()
    assert [fn.__self__ for fn in compiled] == [model[0], model[2]]
    assert "forward" in vars(model[0]) and "forward" not in vars(model)
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == [
        "0.weight", "0.bias", "2.weight", "2.bias"]
    assert strategy("ddp", Mesh(dp=2)).compiled_units() == [model]  # before DDP wraps it
    assert strategy("fsdp", Mesh()).compiled_units() == [model]  # one worker: the plain model


def test_a_cpu_worker_compiles_in_its_own_process_and_a_gpu_worker_as_torch_chooses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's pool of compile processes beside CPU workers that use every core oversubscribes them; a GPU
    node's host cores are idle while its workers compile Triton kernels, one at a time with a single thread."""
    import torch._inductor.config as inductor

    from paratrain.training.state import quiet_compiler

    monkeypatch.setattr(inductor, "compile_threads", 7)  # torch's choice, say (put back after the test)
    quiet_compiler("cuda")
    assert inductor.compile_threads == 7
    quiet_compiler("cpu")
    assert inductor.compile_threads == 1


@pytest.mark.integration
@pytest.mark.matrix(("fsdp", "compile", "3.0e-5"))
def test_the_gpt_compiled_under_fsdp_equals_it_uncompiled_and_says_nothing(tmp_path: Path, corpus: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """10 AdamW steps of the gpt on 2 fsdp workers: compiled kernels sum in another order, so the weights differ by
    rounding only (measured after 10 steps: 3.0e-5; the bound, 1e-4, is the issue's ceiling). The compiled run is
    a process of its own: its standard error, to the process's exit, holds no warning (inductor's C++ build, its
    cache, a leaked semaphore, torch's notices to itself); its summary times the compilation apart from the rate.
    The cache starts empty, as on a user's first run: a warm one skips the code that warned in the CI. (Every
    other layout compiled against one device: test_layouts_features.py.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    flags = ("train", "--quiet", "--dataset", "text", "--data-dir", str(corpus), "--model", "gpt", "--optimizer",
             "adamw", "--width", "64", "--depth", "2", "--heads", "4", "--context", "64", "--batch-size", "16",
             "--steps", "10", "--devices", "2", "--no-tensorboard")
    runs = {}
    for mode in ("eager", "compiled"):
        out = tmp_path / mode
        done = run_cli(*flags, "--strategy", "fsdp", *(["--compile"] if mode == "compiled" else []), "--out", str(out),
                       timeout=600, fresh=mode == "compiled")  # says nothing: from its first import on
        assert done.returncode == 0, done.stderr[-3000:]
        if mode == "compiled":
            assert done.stderr.strip() == "", done.stderr[-3000:]
        runs[mode] = json.loads((out / "summary.json").read_text())
    assert max_abs_diff(weights(tmp_path / "eager"), weights(tmp_path / "compiled")) <= 1e-4
    assert runs["eager"]["compile_s"] is None
    compiled = runs["compiled"]
    assert 0 < compiled["compile_s"] <= compiled["compile_steps_s"] < compiled["train_time_s"]
    # the rate leaves the first 2 steps out, which compiled
    stepping = compiled["train_time_s"] - compiled["compile_steps_s"]
    rate = (compiled["steps"] - 2) * compiled["global_batch_size"] * 64 / stepping
    assert compiled["tokens_per_sec"] == pytest.approx(rate, rel=1e-6)
