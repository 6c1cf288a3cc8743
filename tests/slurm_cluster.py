"""A real Slurm cluster on this machine, for the tests that submit jobs: munged, slurmctld and slurmd (Debian's
slurm-wlm 22.05) with a slurm.conf of the test's own in a temporary folder and ports of their own, so that it
leaves the machine's own Slurm (if any) alone. `.ci/run` installs the packages; where they are missing or the
test is not root, `start` raises OSError with the reason and the tests skip."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

RELAUNCH_AFTER_S = 5.0
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    folder: Path
    env: dict[str, str]  # the client commands' environment (SLURM_CONF)
    daemons: list[subprocess.Popen] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)  # a node's network namespace, where nodes are namespaces
    interfaces: list[str] = field(default_factory=list)  # and its end of the link to the others

    def command(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode:
            raise AssertionError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, script: str, *flags: str) -> str:
        done = subprocess.run(["sbatch", "--parsable", *flags], input=script, env=self.env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.command("scontrol", "show", "job", "-o", job)
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait(self, job: str, states: set[str], timeout: float = 300) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} is {info.get('JobState')} ({info.get('Reason')}) after {timeout} s, "
                                     f"not {states}; slurmctld's log: {self.log('slurmctld')[-2000:]}")
            time.sleep(0.2)

    def start_again(self, job: str) -> None:
        """Make a requeued job eligible now: Slurm holds it about 120 s (BeginTime). slurmd refuses to launch a
        job whose credential is not newer than the job's kill, in whole seconds ("already killed, do not launch
        batch job"), so the job is released a few seconds after its kill, not in the same second."""
        time.sleep(RELAUNCH_AFTER_S)
        self.command("scontrol", "update", f"jobid={job}", "StartTime=now")

    def log(self, name: str) -> str:
        try:
            return (self.folder / f"{name}.log").read_text()
        except OSError:
            return ""


def _munge_works(env: dict[str, str]) -> bool:
    try:
        made = subprocess.run(["munge", "-n"], capture_output=True, timeout=10, env=env)
        return made.returncode == 0 and subprocess.run(["unmunge"], input=made.stdout, capture_output=True,
                                                       timeout=10, env=env).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _start_munge() -> None:
    """munged with the packaged key (made if missing), unless one answers already."""
    if _munge_works(dict(os.environ)):
        return
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        shutil.chown(key, "munge", "munge")
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["munged", "--force"], capture_output=True, timeout=30)
    deadline = time.monotonic() + 10
    while not _munge_works(dict(os.environ)):
        if time.monotonic() > deadline:
            raise OSError("munged did not start")
        time.sleep(0.1)


def _conf(folder: Path, ctld: str, nodes: list[str], ctld_port: int, slurmd_port: int) -> str:
    return "\n".join([
        "ClusterName=paratrain-test", f"SlurmctldHost={ctld}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", f"StateSaveLocation={folder}/state", f"SlurmdSpoolDir={folder}/spool-%n",
        f"SlurmctldPidFile={folder}/slurmctld.pid", f"SlurmdPidFile={folder}/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log", f"SlurmdLogFile={folder}/slurmd-%n.log",
        f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_port}", "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none", "JobRequeue=1", "ReturnToService=2", "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=none", "KillWait=10",
        "SlurmdParameters=config_overrides", *nodes,
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES", ""])


def _check_can_run() -> None:
    if os.geteuid() != 0:
        raise OSError("not root: slurmd and munged run as root here")
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        raise OSError(f"no {', '.join(missing)} (apt install slurm-wlm munge)")
    _start_munge()


@contextmanager
def _running(folder: Path, conf: str, slurmds: list[list[str]]) -> Iterator[Cluster]:
    """slurmctld here and one slurmd per command line of `slurmds` (what runs it: a namespace, say), until all
    the nodes are idle; stopped after."""
    (folder / "state").mkdir(parents=True, exist_ok=True)
    path = folder / "slurm.conf"
    path.write_text(conf)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(path)
    cluster = Cluster(folder, env)
    try:
        cluster.daemons.append(subprocess.Popen(["slurmctld", "-D", "-c", "-f", str(path)], env=env,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        for command in slurmds:
            cluster.daemons.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while cluster.command("sinfo", "-h", "-N", "-o", "%T", check=False).split() != ["idle"] * len(slurmds):
            if time.monotonic() > deadline or any(d.poll() is not None for d in cluster.daemons):
                logs = " ".join(p.read_text()[-1500:] for p in folder.glob("*.log"))
                raise OSError(f"the Slurm cluster did not come up: {logs}")
            time.sleep(0.2)
        yield cluster
    finally:
        for d in cluster.daemons:
            d.terminate()
        for d in cluster.daemons:
            try:
                d.wait(timeout=20)
            except subprocess.TimeoutExpired:
                d.kill()


@contextmanager
def one_node_cluster(folder: Path) -> Iterator[Cluster]:
    """A cluster of this machine as its one node. OSError where it cannot be started here."""
    _check_can_run()
    host = socket.gethostname()
    conf = _conf(folder, host, [f"NodeName={host} CPUs={os.cpu_count() or 1} State=UNKNOWN"], _free_port(),
                 _free_port())
    with _running(folder, conf, [["slurmd", "-D", "-f", str(folder / "slurm.conf"), "-N", host]]) as cluster:
        yield cluster


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def two_node_cluster(folder: Path, subnet: str = "10.78.0") -> Iterator[Cluster]:
    """Two nodes, node1 and node2, each a network namespace (SUBNET.1, SUBNET.2) on a bridge to this machine
    (SUBNET.254, where slurmctld runs), each slurmd with its own host name (a UTS namespace) and a hosts file
    that names them all (a mount namespace): what the tasks see, too. The file system is shared, as a cluster's
    shared storage is. OSError where it cannot be made."""
    _check_can_run()
    if shutil.which("ip") is None or shutil.which("nsenter") is None or shutil.which("unshare") is None:
        raise OSError("no ip(8), nsenter or unshare")
    tag = uuid.uuid4().hex[:5]
    bridge, names = f"ptbr{tag}", [f"ptsl{tag}{i}" for i in (1, 2)]
    links = [(f"pth{tag}{i}", f"ptn{tag}{i}") for i in (1, 2)]
    host = socket.gethostname()
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, (ns, (outside, inside)) in enumerate(zip(names, links, strict=True)):
            _ip("netns", "add", ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", outside, "master", bridge)
            _ip("link", "set", outside, "up")
            _ip("link", "set", inside, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        _remove(bridge, names)
        raise OSError(e.stderr.decode().strip()) from None
    hosts = folder / "hosts"
    folder.mkdir(parents=True, exist_ok=True)
    hosts.write_text(f"127.0.0.1 localhost\n{subnet}.254 {host}\n{subnet}.1 node1\n{subnet}.2 node2\n")
    conf_path = folder / "slurm.conf"
    nodes = [f"NodeName=node{i} NodeAddr={subnet}.{i} CPUs=1 State=UNKNOWN" for i in (1, 2)]
    conf = _conf(folder, f"{host}({subnet}.254)", nodes, _free_port(), _free_port())
    slurmds = [["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "sh", "-c",
                f"hostname node{i} && mount --bind {hosts} /etc/hosts && exec slurmd -D -f {conf_path} -N node{i}"]
               for i, ns in enumerate(names, start=1)]
    try:
        with _running(folder, conf, slurmds) as cluster:
            cluster.namespaces = names
            cluster.interfaces = [inside for _, inside in links]
            yield cluster
    finally:
        _remove(bridge, names)


def _remove(bridge: str, names: list[str]) -> None:
    for ns in names:  # its end of each veth pair goes with it, and so the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", bridge], capture_output=True)
