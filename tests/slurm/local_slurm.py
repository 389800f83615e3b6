"""A one-node SLURM on this machine, from Debian's packages, living in a temporary folder.

    install_slurm()                    # apt-get install slurmctld slurmd slurm-client munge, if missing
    with LocalSlurm() as slurm:        # munged, slurmctld and slurmd, all children of this process
        job, rc = slurm.sbatch(["path/to/script.sbatch", "arg"], cwd=somewhere)

The node is this machine (NodeName = ``hostname -s``, CPUs = the CPUs we may use); the
configuration, munge key and socket, state, spool and logs are in ``slurm.dir``, and the
daemons listen on ports picked free, so a system SLURM or munge is never touched. Each daemon
runs in the foreground as our child; ``stop`` cancels what is still queued, ends the daemons by
their PIDs and then the jobs' processes that outlived them (found by the SLURM_CONF they all
inherit), and removes the folder.

By hand (a cluster to try the templates on): ``sudo python tests/slurm/local_slurm.py``, then
``export SLURM_CONF=...`` as it prints, and ``sbatch`` from another shell; Enter stops it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")  # Debian's names
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")


class Unavailable(RuntimeError):
    """SLURM cannot be brought up here (not root, no apt, no network): a reason to skip."""


def install_slurm(timeout: float = 400) -> str:
    """Install SLURM and munge with apt if a binary is missing; say what was done."""
    if os.geteuid() != 0:
        raise Unavailable("needs root: the SLURM daemons run as root here, and apt-get installs them")
    if all(shutil.which(b) for b in BINARIES):
        return "SLURM and munge were already installed"
    if not shutil.which("apt-get"):
        raise Unavailable(f"no apt-get: install SLURM and munge ({', '.join(PACKAGES)}) to run this test")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "-o", "DPkg::Lock::Timeout=120", "install", "-y", "--no-install-recommends", *PACKAGES]
    start = time.monotonic()
    done = _quiet(install, env, timeout)
    if done.returncode:  # an old package list: refresh it once
        _quiet(["apt-get", "-o", "DPkg::Lock::Timeout=120", "update"], env, timeout)
        done = _quiet(install, env, timeout)
    if done.returncode or not all(shutil.which(b) for b in BINARIES):
        raise Unavailable(f"apt-get could not install {' '.join(PACKAGES)}:\n{done.stdout[-2000:]}")
    return f"installed {' '.join(PACKAGES)} in {time.monotonic() - start:.0f} s"


def _quiet(cmd, env, timeout):
    try:
        return subprocess.run(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(f"{' '.join(cmd[:3])} did not finish within {timeout:.0f} s") from exc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=ultrascale-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
PlugStackConfig={dir}/plugstack.conf
MailProg=/bin/true
# no cgroups: a container may not offer them; jobs are tracked by their process tree
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# `sbatch --wait` sleeps 2 s, then 8, then 32 between its polls while a wait stays under half of
# MinJobAge (default 300 s): a 10 s job was seen done after 42 s. At 4 s it polls every 2 s, and a
# finished job's record is kept at least 4 s, longer than one poll
MinJobAge=4
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    def __init__(self, cpus: int | None = None):
        self.node = socket.gethostname().split(".")[0]  # what `hostname -s` says
        self.cpus = cpus or len(os.sched_getaffinity(0))  # what `nproc` says
        self.dir: Path | None = None
        self.conf: Path | None = None
        self.daemons: dict[str, subprocess.Popen] = {}
        self.jobs: list[str] = []

    # ---- up
    def start(self, timeout: float = 60) -> "LocalSlurm":
        # munged wants every folder above its socket searchable by all, and its key private
        self.dir = Path(tempfile.mkdtemp(prefix="ultrascale-slurm-"))
        self.dir.chmod(0o711)
        for sub in ("state", "spool"):
            (self.dir / sub).mkdir()
        (self.dir / "plugstack.conf").write_text("")
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf = self.dir / "slurm.conf"
        self.conf.write_text(
            SLURM_CONF.format(
                node=self.node, cpus=self.cpus, dir=self.dir, ctld_port=free_port(), slurmd_port=free_port()
            )
        )
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        d = self.dir
        self._daemon(
            "munged",
            [
                "munged",
                "-F",
                f"--key-file={key}",
                f"--socket={d}/munge.socket",
                f"--pid-file={d}/munged.pid",
                f"--seed-file={d}/munged.seed",
                f"--log-file={d}/munged.log",
            ],
        )
        self._wait_for(lambda: (d / "munge.socket").exists(), timeout, "munged to open its socket")
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._daemon("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._wait_for(lambda: self._node_state() == "idle", timeout, f"node {self.node} to be idle")
        return self

    def _daemon(self, name: str, argv: list[str]) -> None:
        with open(self.dir / f"{name}.out", "wb") as log:
            self.daemons[name] = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def _node_state(self) -> str:
        done = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%t"], env=self.env, capture_output=True, text=True, timeout=30
        )
        return done.stdout.strip()

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"no luck in {timeout:.0f} s"
                raise RuntimeError(f"waiting for {what}: {why}\n{self.logs()}")
            time.sleep(0.3)

    # ---- use
    def sbatch(self, argv: list[str], cwd: Path, env: dict | None = None, timeout: float = 300):
        """Submit, wait for the job to end; (job id, its exit code)."""
        done = subprocess.Popen(
            ["sbatch", "--parsable", "--wait", *argv],
            cwd=cwd,
            env={**(env or self.env), "SLURM_CONF": str(self.conf)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        job = done.stdout.readline().strip().split(";")[0]
        self.jobs.append(job)
        try:
            _, err = done.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            subprocess.run(["scancel", job], env=self.env, timeout=30)
            done.kill()
            raise RuntimeError(f"job {job} still running after {timeout:.0f} s: cancelled\n{self.logs()}")
        if not job.isdigit():
            raise RuntimeError(f"sbatch {' '.join(argv)} failed: {err}")
        return job, done.returncode

    def logs(self, lines: int = 15) -> str:
        out = []
        for path in sorted(self.dir.glob("*.out")) + sorted(self.dir.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # ---- down
    def stop(self, grace: float = 20) -> list[str]:
        """Stop everything started here; return what had to be killed after the daemons went."""
        if self.dir is None:
            return []
        if self.daemons.get("slurmctld") and self.daemons["slurmctld"].poll() is None:
            queued = subprocess.run(
                ["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True, timeout=30
            ).stdout.split()
            if queued:
                subprocess.run(["scancel", *queued], env=self.env, timeout=30)
                self._wait_for_empty_queue(grace)
        for name in ("slurmd", "slurmctld", "munged"):  # the reverse of the start
            proc = self.daemons.pop(name, None)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        leftovers = self._kill_leftovers()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None
        return leftovers

    def _wait_for_empty_queue(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not subprocess.run(
                ["squeue", "-h"], env=self.env, capture_output=True, text=True, timeout=30
            ).stdout.strip():
                return
            time.sleep(0.5)

    def _kill_leftovers(self) -> list[str]:
        """Processes still carrying our SLURM_CONF (job steps, ranks): kill them by PID."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    found.append(f"{entry.name} {command}")
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue  # gone meanwhile, or not ours to read
        return found

    def __enter__(self) -> "LocalSlurm":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    print(install_slurm())
    with LocalSlurm() as slurm:
        print(
            f"a one-node SLURM on {slurm.node} ({slurm.cpus} CPUs) is up; in another shell:\n"
            f"  export SLURM_CONF={slurm.conf}\nthen sinfo, sbatch, squeue. Press Enter to stop it."
        )
        input()
