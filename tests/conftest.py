"""Shared helpers: real-data folders (skipped where ../shared is absent) and a CLI runner."""

from __future__ import annotations

import faulthandler
import gzip
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest-xdist's processes (pyproject's addopts: -n auto, one a core)
    # each computes beside the others: OpenMP's waiting threads sleep rather than spin (set before torch starts
    # OpenMP), as the processes of a run's workers do; spinning, some tests of two processes on 2 cores ran 3-12x slower
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

ENVIRON_AT_START = dict(os.environ)  # this test process's, before any test changed it (warm_socket's server)

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
MNIST_DIR = SHARED_DATA / "mnist"
CIFAR_DIR = SHARED_DATA / "cifar-10-batches-bin"


@pytest.fixture(autouse=True, scope="session")
def _own_devices_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """`--devices auto` keeps what it measured (autodevices.py): in the test session's own file, so that no run
    of the tests chooses from what another run, or the user's own training, measured."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PARATRAIN_DEVICES_CACHE", str(tmp_path_factory.mktemp("devices") / "devices.json"))
        # decoded image folders and Datasets go to the user's cache folder: the session's own
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        # the `mlflow server`s the tests start (test_trackers.py, the docs' pages) without MLflow's job runner:
        # its 8 huey processes, each importing mlflow, took a third of a core each beside the run under test
        patch.setenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        yield


@pytest.fixture(autouse=True, scope="module")
def _no_gpu_in_module_fixtures(request: pytest.FixtureRequest) -> Iterator[None]:
    """The same for the module-scoped fixtures that train (they are set up before the function's)."""
    if any(item.get_closest_marker("gpu") for item in request.session.items if item.module is request.module):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        patch.setattr(torch.cuda, "is_available", lambda: False)
        patch.setattr(torch.cuda, "device_count", lambda: 0)
        yield


@pytest.fixture(autouse=True)
def _no_gpu_unless_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test but those marked `gpu` runs as on a machine without a GPU, in this process and in the
    processes it starts: the equivalence bounds were measured on CPUs, and `--devices 2` means two CPU
    workers, also on a machine with one GPU. (A module-scoped fixture that trains runs before this.)"""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    if not (MNIST_DIR / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"real MNIST files not found in {MNIST_DIR} (they come with the project's shared/ folder)")
    return MNIST_DIR


@pytest.fixture
def cifar_dir() -> Path:
    if not (CIFAR_DIR / "data_batch_1.bin.gz").is_file():
        pytest.skip(f"real CIFAR-10 files not found in {CIFAR_DIR} (they come with the project's shared/ folder)")
    return CIFAR_DIR


QUICK = {"quiet": True, "tensorboard": False, "devices": "1"}  # digits_run's


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 5-step lenet5 run on digits, trained once for the module's tests (which leave it as it is)."""
    import paratrain

    run = tmp_path_factory.mktemp("runs") / "digits"
    paratrain.fit(None, "digits", paratrain.TrainConfig(steps=5, out=str(run), **QUICK))
    return run


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 colour PNGs of 3 shapes, 4 a class (examples/make_shapes.py), made once for the module's tests.
    test_own_data.py has a `shapes` of its own, of 20 a class."""
    if str(REPO / "examples") not in sys.path:
        sys.path.insert(0, str(REPO / "examples"))
    import make_shapes

    root = tmp_path_factory.mktemp("shapes")
    make_shapes.write(root, per_class=4)  # colour PNGs, 3 classes
    return root


def main_code(argv: list[str]) -> int:
    """`paratrain ARGV` in this process: its exit code, also when argparse exits."""
    from paratrain.cli import main

    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code)


WARM_CLIENT = Path(__file__).with_name("warm_client.py")
_warm_server: list[subprocess.Popen] = []


def warm_socket() -> str:
    """The socket of this test process's warm `paratrain` (tests/warm_server.py), started on first use: a command
    forked from it starts without importing torch again (3.3 s of CPU a command). It ends with this process."""
    path = Path(tempfile.gettempdir()) / f"paratrain-warm-{os.getpid()}.sock"
    if not _warm_server or _warm_server[0].poll() is not None:
        path.unlink(missing_ok=True)
        log = path.with_suffix(".log")
        with open(log, "wb") as stderr:  # what its imports say, which each command then says (and its own failure)
            _warm_server[:] = [subprocess.Popen(
                [sys.executable, str(WARM_CLIENT.with_name("warm_server.py")), str(path), str(log)],
                stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                env={**ENVIRON_AT_START, "PYTHONUNBUFFERED": "1"})]  # not the environment of the test that asked first
    return str(path)


def paratrain_command(*args: str) -> list[str]:
    """The command line of `paratrain ARGS` through this process's warm server (see run_cli)."""
    return [sys.executable, str(WARM_CLIENT), *args]


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None,
            fresh: bool = False) -> subprocess.CompletedProcess:
    """`python -m paratrain ARGS` as a user would run it: a process of its own, with its arguments, folder,
    environment, streams and exit code; forked from a warm server that has imported torch (tests/warm_server.py),
    or with `fresh`, a new interpreter (what a test of the start itself needs)."""
    command = [sys.executable, "-m", "paratrain", *args] if fresh else paratrain_command(*args)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not fresh:
        env["PARATRAIN_WARM"] = warm_socket()
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def train(run_dir: Path, *args: str, timeout: float = 300) -> dict:
    """Run `paratrain train --quiet --out run_dir ARGS`, insist it succeeded, return its summary."""
    proc = run_cli("train", "--quiet", "--out", str(run_dir), *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def train_here(run_dir: Path, *args: str, timeout: float = 300) -> dict:
    """`paratrain train --quiet --out run_dir ARGS` through the command line's own code, in this process (its
    workers forked from this process's forkserver, already warm): `train` without a fresh interpreter's imports,
    some 3 s a run. Insist it succeeded; return its summary."""
    faulthandler.dump_traceback_later(timeout, exit=True)  # a run that hangs ends the test process, as train's does
    try:
        code = main_code(["train", "--quiet", "--out", str(run_dir), *args])
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert code == 0, f"paratrain train exited {code}"
    return json.loads((run_dir / "summary.json").read_text())


def logged_step(run: Path) -> int:
    """The highest step a (running) run has written to its metrics.jsonl so far; 0 before any."""
    try:
        return max([json.loads(line).get("step", 0) for line in (run / "metrics.jsonl").read_text().splitlines()
                    if line.endswith("}")] or [0])
    except (OSError, json.JSONDecodeError):
        return 0


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of a run's newest checkpoint (one file, or a sharded strategy's folder read whole)."""
    from paratrain.checkpoint import files as checkpoint

    return checkpoint.load(run_dir)["model"]


def adam_moments(state: dict) -> dict[str, torch.Tensor]:
    """A checkpoint's Adam moments, by parameter: what a resumed run must carry over exactly. `state`: a whole-model
    file's (by parameter number), or a step folder's read by `newest_state` (by name)."""
    optimizer = state["optimizer"]
    if "state" in optimizer and isinstance(optimizer["state"], dict):
        return {f"{k}.{m}": v[m] for k, v in optimizer["state"].items() for m in ("exp_avg", "exp_avg_sq")}
    return {k.removeprefix("state."): v for k, v in optimizer.items() if k.endswith((".exp_avg", ".exp_avg_sq"))}


def newest_checkpoint(run: Path) -> Path:
    """The newest step checkpoint of the run folder `run` (a step folder; an earlier release's file)."""
    from paratrain.checkpoint.run_folder import step_checkpoints

    return step_checkpoints(run / "checkpoints")[-1][1]


def newest_state(run: Path) -> dict:
    """The newest checkpoint of `run`, a step folder, read whole in this process: its meta.pt's values, and its
    weights, optimizer state (flat: "state.NAME.exp_avg") and weight average."""
    from paratrain.checkpoint import dcp
    from paratrain.checkpoint import files as checkpoint

    path = newest_checkpoint(run)
    return {**checkpoint.load(path), **dcp.whole(path, parts=dcp.TENSORS)}


def save_step(state: dict, folder: Path, step: int, keep: int = 2) -> Path:
    """Write `state` (a whole checkpoint's values) as a run writes step `step` into its checkpoints `folder`."""
    from paratrain.checkpoint import dcp
    from paratrain.runtime.dist import DistContext

    tensors = {k: state[k] for k in dcp.TENSORS if state.get(k) is not None}
    meta = {k: v for k, v in state.items() if k not in dcp.TENSORS}
    return dcp.save_step(DistContext(0, 1, torch.device("cpu"), None), tensors, lambda: meta, folder, step, keep)


def edit_meta(run: Path, **changes: object) -> None:
    """Change values of the newest checkpoint's meta.pt (its step, configuration) in place."""
    from paratrain.checkpoint import dcp

    path = newest_checkpoint(run) / dcp.META
    meta = torch.load(path, weights_only=True)
    torch.save({**meta, **changes}, path)


def _earlier_release_save(self, optimizer, ema, extras, checkpoints, step: int, keep: int) -> None:  # noqa: ANN001
    """Strategy.save as releases before the one checkpoint format had it for ddp and the tower: rank 0 wrote the
    whole model, the optimizer's own state_dict (by parameter number) and the weight average to one file."""
    if self.ctx.is_main:
        state = {"model": {k: v.detach().cpu() for k, v in self.module.state_dict().items()},
                 "optimizer": optimizer.state_dict(), **extras()}
        if ema is not None:
            state["ema_model"] = {k: v.detach().cpu() for k, v in ema.module.state_dict().items()}
        save_earlier_release_step(state, checkpoints.folder, step)


@contextmanager
def earlier_release() -> Iterator[None]:
    """Within it, ddp runs in this process write their checkpoints as an earlier release did (one whole-model file
    a step)."""
    from unittest import mock

    from paratrain.parallel.strategies.base import Strategy

    with mock.patch.object(Strategy, "save", _earlier_release_save):
        yield


def save_earlier_release_step(state: dict, folder: Path, step: int) -> Path:
    """A step checkpoint as releases before the one checkpoint format wrote it under ddp: one whole-model file
    `step-N.pt` and `last.pt` a hard link to it."""
    from paratrain.checkpoint import files as checkpoint

    path = folder / f"step-{step:08d}.pt"
    checkpoint.save(state, path)  # makes the folder
    (folder / "last.pt").unlink(missing_ok=True)
    os.link(path, folder / "last.pt")
    return path


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    gap = max((a[k].double() - b[k].double()).abs().max().item() for k in a) if a else 0.0
    if os.environ.get("PARATRAIN_GAPS"):  # measuring the gaps that the equivalence bounds are set from
        with open(os.environ["PARATRAIN_GAPS"], "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}\t{gap:.3g}\n")
    return gap


def in_session(sid: int) -> list[int]:
    """The processes of session `sid` (a command started with start_new_session) still running."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid=,stat="], capture_output=True, text=True).stdout
    return [int(p) for p, s, stat in (line.split() for line in out.splitlines()) if int(s) == sid and stat[0] != "Z"]


def left_in_session(sid: int, within: float) -> list[int]:
    """The processes of session `sid` still running once none is, or `within` seconds have passed."""
    deadline = time.monotonic() + within
    while (left := in_session(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        children.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def kill_a_worker_midway(command: list[str], run: Path, at_step: int, cwd: Path | None = None) -> tuple[int, str]:
    """Start `command` (a run of 2 workers writing to `run`), kill -9 its second worker once the run has logged
    `at_step`, and wait for it to end: its exit code and standard error."""
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    try:
        deadline = time.monotonic() + 120

        def wait_for(step: int) -> None:
            while logged_step(run) < step:
                assert time.monotonic() < deadline and launcher.poll() is None, "the run did not get going"
                time.sleep(0.002)

        wait_for(1)  # the workers are found while they train, so the kill follows `at_step` without a `ps` between
        workers = training_workers(launcher.pid)
        assert len(workers) == 2, workers
        wait_for(at_step)
        os.kill(workers[1], signal.SIGKILL)
        code = launcher.wait(timeout=240)
    finally:
        launcher.kill()
    return code, launcher.stderr.read()


def training_workers(pid: int) -> list[int]:
    """The training workers that process `pid` started, in start (pid) order: spawned ones, or forked from its
    forkserver (paratrain's default, prefork.py); not the forkserver itself nor multiprocessing's resource
    tracker."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    parent = {p: pp for p, pp in (map(int, line.split()) for line in out.splitlines())}
    mine = set(descendants(pid))
    # its forkserver is its child; the workers forked from it carry the same command line, one level down
    forkservers = {p for p in mine if parent.get(p) == pid and b"forkserver" in _cmdline(p)}
    return sorted(p for p in mine if b"spawn_main" in _cmdline(p) or parent.get(p) in forkservers)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes (its parent may not have reaped it yet)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def veth_namespaces(subnet: str) -> Iterator[tuple[list[str], list[str]]]:
    """Two network namespaces joined by a veth pair, `subnet`.1 and `subnet`.2 (made here, removed after):
    yields (namespaces, links). Raises OSError, with the reason, where they cannot be made (not root, no
    ip(8), no permission); nothing is left behind then."""
    tag = uuid.uuid4().hex[:5]
    names, links = [f"pt{tag}a", f"pt{tag}b"], [f"pv{tag}a", f"pv{tag}b"]
    try:
        if os.geteuid() != 0 or not shutil.which("ip"):
            raise OSError("not root, or no ip(8)")
        for ns in names:
            _ip("netns", "add", ns)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for i, (ns, link) in enumerate(zip(names, links, strict=True)):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (OSError, subprocess.CalledProcessError) as e:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        reason = e.stderr.decode().strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
        raise OSError(reason) from None
    try:
        yield names, links
    finally:  # removing a namespace removes its end of the veth pair, and so the pair
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class FakeGPUs:
    """An inventory of `count` GPUs as torch.cuda reports it (count, names, memory, capability, peer
    access), for the planning paths that must be right before the first GPU is lent; nothing runs on them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch

    def __call__(self, count: int, name: str = "NVIDIA H100 80GB HBM3", memory_gib: int = 80,
                 capability: tuple[int, int] = (9, 0)) -> None:
        from types import SimpleNamespace

        props = SimpleNamespace(name=name, total_memory=memory_gib * 2**30, major=capability[0], minor=capability[1])
        patch = self.monkeypatch
        patch.setattr(torch.cuda, "device_count", lambda: count)
        patch.setattr(torch.cuda, "is_available", lambda: count > 0)
        patch.setattr(torch.cuda, "get_device_properties", lambda i: props)
        patch.setattr(torch.cuda, "mem_get_info", lambda i=0: (memory_gib * 2**30 - 2**30, memory_gib * 2**30))
        patch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: True)
        patch.setattr(torch.cuda, "set_device", lambda device: None)


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> FakeGPUs:
    """fake_gpus(N): torch.cuda reports N GPUs (see FakeGPUs)."""
    return FakeGPUs(monkeypatch)


# ---- a throw-away PostgreSQL server (a search's study shared by several processes or jobs) ----

def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for folder in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (folder / name).exists():
            return str(folder / name)
    return None


@pytest.fixture
def postgres() -> str:
    """A throw-away PostgreSQL server from the system's binaries; its URL."""
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed; .ci/run installs them")
    pytest.importorskip("psycopg", reason="the psycopg driver is not installed (pip install 'psycopg[binary]')")
    # not under pytest's tmp_path: that is private to root, and the server runs as another user
    folder = Path(tempfile.mkdtemp(prefix="paratrain-pg-"))
    run_as: list[str] = []
    if os.geteuid() == 0:  # the server refuses to run as root
        os.chmod(folder, 0o777)
        run_as = ["runuser", "-u", "postgres", "--"]
    data, port = folder / "data", free_port()
    subprocess.run([*run_as, initdb, "-D", str(data), "-U", "postgres", "--auth=trust"], check=True,
                   capture_output=True)
    subprocess.run([*run_as, pg_ctl, "-D", str(data), "-l", str(folder / "log"), "-w", "-o",
                    f"-p {port} -k {folder} -c listen_addresses=127.0.0.1", "start"], check=True, capture_output=True)
    yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    subprocess.run([*run_as, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True)
    shutil.rmtree(folder, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 310 kB of English, one file (the language model's tests): the project's documentation pages and
    README as of commit 5820e3d, kept fixed in tests/data. Read from the live docs, every edit of a page moved
    the tests' figures, and three of them broke a bound (by 1e-6 to 2.5e-5) that had held before the edit."""
    path = tmp_path_factory.mktemp("text") / "docs.txt"
    path.write_bytes(gzip.decompress((Path(__file__).parent / "data" / "corpus.txt.gz").read_bytes()))
    return path


# a network that fails during training, as the user's own code would (the tests of crashes and their ends)
CRASHING = """
import os, signal
import torch
import torch.distributed as dist

STEPS = [0]

def build(channels, num_classes):
    return Net(channels * 28 * 28, num_classes)

class Net(torch.nn.Module):
    def __init__(self, inputs, classes):
        super().__init__()
        self.fc = torch.nn.Linear(inputs, classes)

    def forward(self, x):
        if self.training and torch.is_grad_enabled() and dist.is_initialized():
            STEPS[0] += 1
            if STEPS[0] == 4:
                {fault}
        return self.fc(x.flatten(1))
"""


def crashing_model(tmp_path: Path, fault: str) -> str:
    """A network file (`--model PATH:build`) whose 4th training forward in a worker runs `fault`."""
    path = tmp_path / "net.py"
    path.write_text(CRASHING.format(fault=fault))
    return f"{path}:build"


def wait_for(condition, timeout: float, what: str) -> None:  # noqa: ANN001
    """Poll `condition` until it holds; fail the test naming `what` after `timeout` seconds."""
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """-n auto (pyproject's addopts) is for the fast tests: a selection of those that start processes, bound wall
    times, read the real datasets or share GPUs (`-m integration`, `slow`, `gpu`) runs in this process, one test at
    a time, unless -n is given (.ci/run gives -n 3 to the integration and slow tests that may run beside another). None:
    xdist's own count, a process a core."""
    chosen = re.sub(r"\bnot\s+\w+", "", config.getoption("markexpr") or "")
    return 0 if re.search(r"\b(integration|slow|gpu)\b", chosen) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup` (pyproject's addopts: the fast tests), the tests that use a fixture set up once for
    their module (a trained run) go to one test process, so the fixture is set up once there; every other test
    goes to whichever process is free. A module that names a `HEAVY_IMPORT` (a library of seconds to import) has
    its fast tests in one process too, which alone imports it. (.ci/run's integration tier gives each process a
    file, --dist loadfile, which these marks leave as it is: by test it took 53 minutes, against 47 by file.)"""
    for item in items:
        infos, module = getattr(item, "_fixtureinfo", None), getattr(item, "module", None)
        if infos is None or module is None:  # (a doctest)
            continue
        shared = [name for name, defs in infos.name2fixturedefs.items()
                  if not name.startswith("_") and defs and defs[-1].scope in ("module", "package")]
        if shared:  # by module: its fixtures may build on each other (two_nodes.py's run on its network namespaces)
            item.add_marker(pytest.mark.xdist_group(module.__name__))
        elif getattr(module, "HEAVY_IMPORT", None) and item.get_closest_marker("integration") is None:
            # a library of seconds to import (mlflow, transformers), imported by one test process, not by each
            item.add_marker(pytest.mark.xdist_group(module.HEAVY_IMPORT))


def write_examples(path: Path, count: int = 160, chat: bool = False) -> Path:
    """`count` instruction examples as JSON lines (--dataset jsonl), from the fixed corpus: a line of it as the
    prompt, the line after it as the response; or the same pairs as {"messages"} chats."""
    import json

    lines = [line.strip() for line in gzip.decompress((Path(__file__).parent / "data" / "corpus.txt.gz")
                                                      .read_bytes()).decode().splitlines() if 20 < len(line) < 50]
    with open(path, "w") as f:
        for prompt, response in zip(lines[:count], lines[1:count + 1], strict=True):
            example = {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]} \
                if chat else {"prompt": prompt + "\n", "response": response}
            f.write(json.dumps(example) + "\n")
    return path


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """160 prompt/response pairs of the fixed corpus's lines, as JSON lines (--dataset jsonl)."""
    return write_examples(tmp_path_factory.mktemp("jsonl") / "pairs.jsonl")
