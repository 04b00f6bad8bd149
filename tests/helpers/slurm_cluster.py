"""A real SLURM cluster on this machine, for tests/test_slurm.py: Debian's slurm-wlm 22.05 daemons,
each "machine" its own network, UTS, mount and PID namespace.

    with SlurmCluster(tmp_path, nodes=2) as cluster:
        job = cluster.sbatch(script, cwd=repo, env=env)
        state = cluster.wait(job, timeout=120)

Layout (the network is bench._netns's `Cluster`: one bridge, host i at 10.77.0.<i+1>):

- host 0, hostname `ctl`: slurmctld. Every client command (sbatch, scontrol, squeue) runs there.
- host i >= 1, hostname `node<i>`: one slurmd, so SLURM_NODELIST reads `node[1-N]` and
  `scontrol show hostnames` gives names, resolved through a hosts file bind-mounted over
  /etc/hosts inside each host's mount namespace only.
- one munged of its own (key and socket in the cluster's directory: a Unix socket is reached from
  every network namespace), so nothing under /etc or /run is touched.

Why these namespaces and not `ip netns exec`: it remounts /sys in a fresh mount namespace, and
slurmd 22.05 then fails on /sys/fs/cgroup; entering only the network namespace (`nsenter --net`)
and making the UTS (hostname), mount (hosts file) and PID namespaces with `unshare` works. A PID
namespace per node lets `kill_node` end a machine as a power cut does: its slurmd, slurmstepd and
every task die together. The plugins are the ones that need no cgroup: proctrack/linuxproc,
task/none. Needs root, iproute2, util-linux and the packages `slurm-wlm` and `munge`; `available()`
says what is missing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from bench import _netns

_DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "scontrol", "nsenter", "unshare")
_START_TIMEOUT_S = 30.0
_CMD_TIMEOUT_S = 30.0
ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
)


class SlurmError(RuntimeError):
    """The emulated cluster could not be built or did not answer; names the command or daemon."""


def available() -> tuple[bool, str]:
    """Whether this machine can run the cluster, and if not what is missing."""
    missing = [tool for tool in _DAEMONS if shutil.which(tool) is None]
    if missing:
        return False, f"not installed: {', '.join(missing)} (Debian packages slurm-wlm and munge)"
    return _netns.available()


class SlurmCluster:
    """slurmctld and `nodes` slurmd daemons with their own munged; see the module docstring."""

    def __init__(self, directory: Path, nodes: int = 2, cpus: int = 2, slurmd_timeout_s: int = 10) -> None:
        self.dir = directory
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus
        self.slurmd_timeout_s = slurmd_timeout_s
        self.conf = directory / "slurm.conf"
        self._net = _netns.Cluster(nodes + 1, 1000, _netns.random_prefix())
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self._munged_pid_file = directory / "munge" / "pid"

    # --- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._net.__enter__()
        self._start_munge()
        self._write_config()
        self._daemons["ctl"] = self._in_host(0, "ctl", ["slurmctld", "-D", "-i"])
        for index, node in enumerate(self.nodes, start=1):
            (self.dir / f"slurmd.{node}").mkdir()
            self._daemons[node] = self._in_host(index, node, ["slurmd", "-D"])
        self._await_idle()

    def close(self) -> None:
        """Stops every daemon and removes the namespaces; safe on a half-built cluster."""
        for proc in self._daemons.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self._daemons.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self._daemons.clear()
        if self._munged_pid_file.exists():
            with contextlib.suppress(ValueError, ProcessLookupError):
                os.kill(int(self._munged_pid_file.read_text().split()[0]), signal.SIGTERM)
        self._net.destroy()

    # --- building -----------------------------------------------------------------------------

    def _start_munge(self) -> None:
        munge = self.dir / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        _run("mungekey", "--create", f"--keyfile={key}")
        key.chmod(0o600)
        self.munge_socket = munge / "sock"
        _run(
            "munged",
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--log-file={munge / 'log'}",
            f"--pid-file={self._munged_pid_file}",
            f"--seed-file={munge / 'seed'}",
        )

    def _write_config(self) -> None:
        d = self.dir
        (d / "state").mkdir()
        hosts = ["127.0.0.1 localhost", f"{self._net.hosts[0].ip} ctl"]
        hosts += [f"{host.ip} {node}" for host, node in zip(self._net.hosts[1:], self.nodes, strict=True)]
        (d / "hosts").write_text("\n".join(hosts) + "\n")
        nodes = [
            f"NodeName={node} NodeAddr={host.ip} CPUs={self.cpus} State=UNKNOWN"
            for host, node in zip(self._net.hosts[1:], self.nodes, strict=True)
        ]
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=gradserver",
                    f"SlurmctldHost=ctl({self._net.hosts[0].ip})",
                    "SlurmUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.munge_socket}",
                    f"StateSaveLocation={d / 'state'}",
                    f"SlurmdSpoolDir={d}/slurmd.%n",
                    f"SlurmctldPidFile={d}/slurmctld.pid",
                    f"SlurmdPidFile={d}/slurmd.%n.pid",
                    f"SlurmctldLogFile={d}/slurmctld.log",
                    f"SlurmdLogFile={d}/slurmd.%n.log",
                    # Neither needs cgroups, which slurmd cannot use inside these namespaces.
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "MpiDefault=none",
                    "MailProg=/bin/true",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "ReturnToService=2",
                    f"SlurmdTimeout={self.slurmd_timeout_s}",
                    # SLURM's default: what a task has between srun's SIGTERM and its SIGKILL.
                    "KillWait=30",
                    "MinJobAge=600",
                    *nodes,
                    f"PartitionName=debug Nodes=node[1-{len(self.nodes)}] Default=YES State=UP",
                ]
            )
            + "\n"
        )

    def _in_host(self, index: int, hostname: str, argv: list[str]) -> subprocess.Popen[bytes]:
        """Starts a daemon in host `index`'s network namespace with hostname and hosts file of
        its own, as the child of a shell that is PID 1 of a new PID namespace (see the module
        docstring): the daemon can die alone, and the shell's death ends the machine."""
        host = self._net.hosts[index]
        # PID 1 outlives the daemon (a node whose slurmd died keeps its slurmstepd and tasks),
        # and its death ends the machine.
        script = (
            f'hostname {hostname} && mount --bind "$1" /etc/hosts && shift && '
            '{ "$@"; echo "$1 exited ($?)"; exec sleep 86400; }'
        )
        log = open(self.dir / f"{hostname}.out", "wb")  # noqa: SIM115 - the daemon's, closed with it
        with log:
            return subprocess.Popen(
                [
                    "nsenter",
                    f"--net=/run/netns/{host.namespace}",
                    "unshare",
                    "--uts",
                    "--mount",
                    "--pid",
                    "--fork",
                    "--mount-proc",
                    "sh",
                    "-c",
                    script,
                    "sh",
                    str(self.dir / "hosts"),
                    *argv,
                ],
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _await_idle(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        states = ""
        while time.monotonic() < deadline:
            for name, proc in self._daemons.items():
                if proc.poll() is not None or " exited (" in self.log_tail(name, 1):
                    raise SlurmError(f"{name}'s daemon exited: {self.log_tail(name)}")
            result = self.client("sinfo", "--noheader", "--Node", "--format=%N %T", check=False)
            states = result.stdout.strip()
            idle = dict(line.split() for line in states.splitlines() if len(line.split()) == 2)
            if all(idle.get(node) == "idle" for node in self.nodes):
                return
            time.sleep(0.2)
        logs = "; ".join(f"{name}: {self.log_tail(name, 5)}" for name in self._daemons)
        raise SlurmError(
            f"the nodes were not idle within {_START_TIMEOUT_S:g} s: {states or 'no answer'} ({logs})"
        )

    # --- using it -----------------------------------------------------------------------------

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (this process's environment by default) with SLURM_CONF pointing here."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def client(
        self, *argv: str, env: dict[str, str] | None = None, cwd: Path | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """A SLURM client command, run on the controller's host."""
        full = ["ip", "netns", "exec", self._net.hosts[0].namespace, *argv]
        result = subprocess.run(
            full,
            capture_output=True,
            text=True,
            env=self.env(env),
            cwd=cwd,
            timeout=_CMD_TIMEOUT_S,
            check=False,
        )
        if check and result.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def sbatch(
        self, script: Path, *options: str, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> int:
        """Submits `script`; its job id."""
        out = self.client("sbatch", "--parsable", *options, str(script), env=env, cwd=cwd).stdout
        return int(out.strip().split(";")[0])

    def job_state(self, job: int) -> str:
        """JobState from `scontrol show job` (PENDING, RUNNING, COMPLETED, FAILED, ...)."""
        out = self.client("scontrol", "show", "job", "--oneliner", str(job)).stdout
        found = re.search(r"\bJobState=(\S+)", out)
        if not found:
            raise SlurmError(f"scontrol show job {job} gave no JobState: {out.strip()}")
        return found[1]

    def wait(self, job: int, timeout: float) -> str:
        """Waits (bounded) until the job ended; its final state."""
        deadline = time.monotonic() + timeout
        state = "unknown"
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state in ENDED:
                return state
            time.sleep(0.5)
        self.client("scancel", str(job), check=False)
        raise SlurmError(f"job {job} did not end within {timeout:g} s (last state {state})")

    def wait_running(self, job: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job)) != "RUNNING":
            if state in ENDED or time.monotonic() >= deadline:
                raise SlurmError(f"job {job} is {state}, not RUNNING (waited up to {timeout:g} s)")
            time.sleep(0.2)

    def daemon_pid(self, name: str) -> int:
        """The pid (here) of the process that holds `name`'s namespaces (`ctl` or a node): every
        process of that machine descends from it."""
        return self._daemons[name].pid

    def kill_node(self, node: str) -> None:
        """Ends `node` as a power cut does: SIGKILL to its PID namespace's first process, which
        takes slurmd, every slurmstepd and every task of the node with it."""
        os.kill(self._first_inside(node), signal.SIGKILL)

    def kill_slurmd(self, node: str) -> None:
        """SIGKILL to `node`'s slurmd alone: its slurmstepd and tasks go on."""
        init = self._first_inside(node)
        # slurmstepd daemonizes, so it is a child of PID 1 too: the one named slurmd.
        children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
        slurmd = [pid for pid in children if Path(f"/proc/{pid}/comm").read_text().strip() == "slurmd"]
        if not slurmd:
            raise SlurmError(f"{node}: its slurmd is not running")
        os.kill(int(slurmd[0]), signal.SIGKILL)

    def _first_inside(self, name: str) -> int:
        """The pid (here) of PID 1 of `name`'s PID namespace."""
        unshare = self._daemons[name].pid  # nsenter exec'd unshare; its child is the PID 1 inside
        children = Path(f"/proc/{unshare}/task/{unshare}/children").read_text().split()
        if not children:
            raise SlurmError(f"{name}: no process inside its PID namespace")
        return int(children[0])

    def log_tail(self, name: str, lines: int = 20) -> str:
        """The end of a daemon's output (name: `ctl` or a node)."""
        path = self.dir / f"{name}.out"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _run(*argv: str) -> None:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise SlurmError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
