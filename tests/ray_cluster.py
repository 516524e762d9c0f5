"""A throwaway local multi-node Ray cluster (`ray start --head` + `ray start --address`) for tests.

Every process gets the same `RAY_AUTH_MODE` (Ray 2.60 turns token auth on for clusters started
with `ray start`). The cluster is torn down by process id: every process whose command line names
our private temp dir, and their children -- never `ray stop`, which would also stop other people's
clusters on the machine.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AUTH_MODE = "token"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def cluster_env() -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["RAY_AUTH_MODE"] = AUTH_MODE
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class LocalCluster:
    """Head node + worker nodes on this machine, each with its own CPU count."""

    def __init__(self, node_cpus: tuple[int, ...] = (2, 1), dashboard: bool = False):
        self.temp = tempfile.mkdtemp(prefix="eagle-mn-", dir="/tmp")  # short: Ray's socket paths must fit 107 chars
        self.env = cluster_env()
        self.node_cpus = node_cpus
        self.dashboard = dashboard        # the Jobs API lives in the dashboard
        self.gcs = self.dashboard_address = None

    def start(self) -> "LocalCluster":
        gcs, dash, client, *agents = free_ports(3 + len(self.node_cpus))
        self.gcs = f"127.0.0.1:{gcs}"
        common = ["--disable-usage-stats"]
        try:
            self.dashboard_address = f"http://127.0.0.1:{dash}"
            self._ray("start", "--head", "--port", str(gcs), "--num-cpus", str(self.node_cpus[0]),
                      "--include-dashboard", str(self.dashboard).lower(), "--dashboard-host", "127.0.0.1",
                      "--dashboard-port", str(dash),
                      "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agents[0]),
                      "--temp-dir", self.temp, *common)
            for cpus, agent in zip(self.node_cpus[1:], agents[1:]):
                self._ray("start", "--address", self.gcs, "--num-cpus", str(cpus),
                          "--dashboard-agent-listen-port", str(agent), *common)
        except BaseException:
            self.stop()
            raise
        return self

    def _ray(self, *args: str) -> None:
        r = subprocess.run(["ray", *args], env=self.env, capture_output=True, text=True, timeout=180)
        if r.returncode:
            raise RuntimeError(f"ray {' '.join(args[:2])} failed:\n{r.stdout}\n{r.stderr}")

    def driver(self, *args: str, timeout: float = 240) -> dict:  # (tests/cluster/multinode.py's commands)
        """Run a driver command of this module against the cluster; its JSON answer."""
        r = subprocess.run([sys.executable, "-m", "tests.cluster.multinode", self.gcs, *args], cwd=REPO,
                           env=self.env, capture_output=True, text=True, timeout=timeout)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode or not lines:
            raise RuntimeError(f"driver {args[0]} failed (rc={r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
        return json.loads(lines[-1])

    def drain_for_preemption(self, node_id: str, notice_s: int = 60) -> None:
        """What a cloud's preemption notice makes the autoscaler do: drain the node with the preemption
        reason (the node keeps running until `kill_node` takes it: the VM taken back)."""
        self._ray("drain-node", "--address", self.gcs, "--node-id", node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                  "--reason-message", "spot instance preempted (test)", "--deadline-remaining-seconds", str(notice_s))

    def stop(self) -> None:
        kill_tree(self.temp)
        shutil.rmtree(self.temp, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def kill_node(node_id: str, graceful: bool = False) -> None:
    """A node of a local cluster gone: SIGKILL to its raylet, then to every process under it (a VM
    vanishing: Ray reports its actors lost with the node, `preempted` if it was drained so), or with
    `graceful` SIGTERM to the raylet (a deleted pod: "terminated expectedly"). The raylet goes first:
    a worker killed before it would be reported as a process death."""
    import psutil

    marker = f"--node_id={node_id}"
    raylets = [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]
    rest = [c for p in raylets for c in p.children(recursive=True)]
    for p in raylets:
        p.terminate() if graceful else p.kill()
    psutil.wait_procs(raylets, timeout=20)
    for p in rest:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(rest, timeout=5)


def kill_tree(marker: str, timeout: float = 1.0) -> None:
    """Terminate the processes whose command line contains `marker`, and their children, by pid
    (a throwaway cluster: what has not ended a second after SIGTERM is killed)."""
    import psutil

    me = os.getpid()
    roots = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != me and any(marker in a for a in (p.info["cmdline"] or [])):
                roots.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    procs = set(roots)
    for p in roots:
        try:
            procs.update(p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    procs = {p for p in procs if p.pid != me}
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs), timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
