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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

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


def _conf(folder: Path, host: str, cpus: int, ctld_port: int, slurmd_port: int) -> str:
    return "\n".join([
        "ClusterName=paratrain-test", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", f"StateSaveLocation={folder}/state", f"SlurmdSpoolDir={folder}/spool-%n",
        f"SlurmctldPidFile={folder}/slurmctld.pid", f"SlurmdPidFile={folder}/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log", f"SlurmdLogFile={folder}/slurmd.log",
        f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_port}", "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none", "JobRequeue=1", "ReturnToService=2", "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=none", "KillWait=10",
        "SlurmdParameters=config_overrides",
        f"NodeName={host} CPUs={cpus} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES", ""])


@contextmanager
def one_node_cluster(folder: Path) -> Iterator[Cluster]:
    """A cluster of this machine as its one node. OSError where it cannot be started here."""
    if os.geteuid() != 0:
        raise OSError("not root: slurmd and munged run as root here")
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        raise OSError(f"no {', '.join(missing)} (apt install slurm-wlm munge)")
    _start_munge()
    host = socket.gethostname()
    (folder / "state").mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(_conf(folder, host, os.cpu_count() or 1, _free_port(), _free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for name in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        del env[name]
    cluster = Cluster(folder, env)
    try:
        cluster.daemons.append(subprocess.Popen(["slurmctld", "-D", "-c", "-f", str(conf)], env=env,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        cluster.daemons.append(subprocess.Popen(["slurmd", "-D", "-f", str(conf), "-N", host], env=env,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while "idle" not in cluster.command("sinfo", "-h", "-o", "%T", check=False):
            if time.monotonic() > deadline or any(d.poll() is not None for d in cluster.daemons):
                raise OSError(f"the one-node Slurm cluster did not come up: {cluster.log('slurmctld')[-1500:]} "
                              f"{cluster.log('slurmd')[-1500:]}")
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
