"""A cluster of N "hosts" on one Linux machine, joined by a bandwidth-shaped Ethernet.

Used by the tests and benchmarks to run real multi-host Open MPI jobs without ssh or a second
machine. Topology of :class:`EmulatedCluster` (everything inside namespaces this module creates;
the root namespace's links and routes are never touched)::

      namespace <prefix>-h0 (host0)          namespace <prefix>-sw (the switch)
      eth0 10.77.0.1/24  tbf <bandwidth> ─── veth ─── p0 tbf <bandwidth> ─┐
      namespace <prefix>-h1 (host1)                                       ├─ bridge br0
      eth0 10.77.0.2/24  tbf <bandwidth> ─── veth ─── p1 tbf <bandwidth> ─┘

Each direction of each host's link is shaped (the host's ``eth0`` for what it sends, its
switch port for what it receives), like a full-duplex switched Ethernet port. Commands run in
a host's namespace under ``unshare --uts`` with the host's own hostname, and each namespace
gets its own ``/etc/hosts`` (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` bind-mounts)
so the hosts resolve each other by name. Open MPI reaches the other hosts through an
``rsh`` agent script that maps a host name to its namespace — the part ssh plays on a real
cluster. Open MPI needs the different hostnames: with one hostname it would treat all ranks as
one node and try shared memory across hosts.

:class:`ShapedLoopback` is the cheaper single-namespace variant (all ranks on one "host",
its shaped ``lo`` carrying the MPI traffic over TCP), with the same interface.

Measured figures (2 busy cores, Open MPI 5.0.11, mpi4py; commands and discussion in
docs/cluster.md): 64 MB float32 ``Allreduce`` between 2 hosts 0.57 s at 1 gbit (the wire floor
is 0.54 s), 0.13-0.16 s at 10 gbit (CPU-bound: unshaped is no faster); a 1 KB ``Allreduce``
0.015-0.02 ms. Launch with ``--bind-to none`` (``mpirun_args`` does): Open MPI's default binds
every host's first rank to core 0 — the same core for all emulated hosts — which made the
same measurements 0.87 s and 8 ms.

Lifetime: use as a context manager. Teardown (also on exceptions, Ctrl-C, SIGTERM and SIGHUP)
kills every process left in the namespaces, deletes them (their links, bridge and qdiscs go
with them) and their ``/etc/netns`` entries. A run killed with SIGKILL leaves objects behind;
the next cluster's start removes them (:func:`tf_poseidon.testing.netns.sweep_leftovers`).
Requires root (CAP_NET_ADMIN, CAP_SYS_ADMIN); :func:`available` says whether it works here.
"""

from __future__ import annotations

import functools
import os
import subprocess
from typing import Mapping, Sequence

from tf_poseidon.launcher import find_mpirun
from tf_poseidon.testing import netns

SUBNET = "10.77.0"  # private; exists only inside each cluster's own switch namespace
RUN_TIMEOUT_S = 120.0


@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
    """(True, "") if an EmulatedCluster can be built on this machine, else (False, why).

    Builds and tears down a 2-host shaped cluster once per process (about a second) and
    runs a command on a host; the result is cached.
    """
    if os.geteuid() != 0:
        return False, "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    try:
        with EmulatedCluster(2, "1gbit") as cluster:
            done = cluster.run(["hostname"], host=cluster.hosts[1], timeout=20)
            if done.returncode != 0 or done.stdout.strip() != cluster.hosts[1]:
                return False, f"running a command on an emulated host failed: {done.stderr}"
    except (netns.NetnsError, OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot build an emulated cluster here: {e}"
    return True, ""


class _NamespacedCluster:
    """What both cluster kinds share: ownership, running commands, guaranteed teardown."""

    hosts: list[str]

    def __init__(self) -> None:
        self._lock: netns.RunLock | None = None
        self._namespaces: dict[str, str] = {}  # host -> namespace
        self._extra_namespaces: list[str] = []  # the switch
        self._signals = netns.signals_become_exceptions()

    # -- lifetime -------------------------------------------------------------------------

    def __enter__(self):
        self._signals.__enter__()
        try:
            netns.sweep_leftovers()
            self._lock = netns.RunLock()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _build(self) -> None:
        raise NotImplementedError

    @property
    def prefix(self) -> str:
        """The run prefix every object of this cluster is named with (``tpc-<8 hex>``)."""
        assert self._lock is not None, "use the cluster as a context manager"
        return self._lock.prefix

    def _all_namespaces(self) -> list[str]:
        return list(self._namespaces.values()) + self._extra_namespaces

    def close(self) -> None:
        """Kills the cluster's processes and deletes all it created. Idempotent; blocks a few
        seconds at most; signals arriving meanwhile are acted on once it is done. Raises
        NetnsError if a namespace could not be removed (after trying all of them)."""
        errors = []
        try:
            with netns.signals_deferred():
                if self._lock is not None:
                    names = self._all_namespaces()
                    netns.kill_namespace_processes(names)
                    for name in names:
                        try:
                            netns.delete_namespace(name)
                        except netns.NetnsError as e:
                            errors.append(str(e))
                    left = set(names) & set(netns.list_namespaces())
                    if left:
                        errors.append(f"namespaces still present after teardown: {sorted(left)}")
                    else:
                        self._lock.release()
                        self._lock = None
                self._namespaces.clear()
                self._extra_namespaces.clear()
        finally:
            self._signals.__exit__(None, None, None)
        if errors:
            raise netns.NetnsError("; ".join(errors))

    # -- commands -------------------------------------------------------------------------

    def namespace(self, host: str) -> str:
        """The network namespace that plays ``host``."""
        try:
            return self._namespaces[host]
        except KeyError:
            raise ValueError(f"{host!r} is not a host of this cluster ({self.hosts})") from None

    def command_on(self, host: str, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` on ``host``: in its namespace, with its hostname."""
        return ["ip", "netns", "exec", self.namespace(host), "unshare", "--uts",
                "sh", "-c", 'hostname "$0" && exec "$@"', host, *argv]

    def run(self, argv: Sequence[str], *, host: str | None = None,
            timeout: float = RUN_TIMEOUT_S, env: Mapping[str, str] | None = None,
            ) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` on ``host`` (default: the first host, where ``mpirun`` belongs) and
        returns its CompletedProcess with stdout/stderr captured as text.

        Blocks until the command exits or ``timeout`` seconds pass. On timeout every process
        in the cluster's namespaces is killed (an MPI job spans all hosts) and
        subprocess.TimeoutExpired is raised with the output collected so far. ``env`` is
        added to this process's environment.
        """
        host = self.hosts[0] if host is None else host
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(self.command_on(host, argv), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=full_env)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            netns.kill_namespace_processes(list(self._namespaces.values()))
            proc.kill()
            stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, stdout, stderr) from None
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    def _shape(self, namespace: str, device: str, bandwidth: str | None,
               burst: str, queue_latency: str) -> None:
        if bandwidth is not None:
            netns.command(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root",
                           "tbf", "rate", bandwidth, "burst", burst, "latency", queue_latency])

    @staticmethod
    def _root_args() -> list[str]:
        return ["--allow-run-as-root"] if os.geteuid() == 0 else []


class EmulatedCluster(_NamespacedCluster):
    """``n_hosts`` emulated hosts on a switched Ethernet of ``bandwidth`` per link direction.

    ``bandwidth``: a tc rate ("1gbit", "10gbit", "100mbit") or None for unshaped links.
    ``burst`` and ``queue_latency`` are the tbf bucket size and the longest a packet may
    queue before being dropped. Hosts are named host0 … host{n-1}; host0 is where ``run``
    starts commands by default and where ``mpirun`` must run. Build with ``with``: creation
    takes well under a second per host, and blocks (each command has a timeout).
    """

    def __init__(self, n_hosts: int, bandwidth: str | None = "1gbit", *,
                 burst: str = "1mb", queue_latency: str = "50ms") -> None:
        super().__init__()
        if not 1 <= n_hosts <= 250:
            raise ValueError(f"n_hosts must be in 1..250, got {n_hosts}")
        self.hosts = [f"host{i}" for i in range(n_hosts)]
        self.bandwidth = bandwidth
        self._burst = burst
        self._queue_latency = queue_latency
        self.addresses = {host: f"{SUBNET}.{i + 1}" for i, host in enumerate(self.hosts)}

    def _build(self) -> None:
        switch = f"{self.prefix}-sw"
        self._extra_namespaces.append(switch)
        netns.add_namespace(switch)
        netns.command(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"])
        netns.command(["ip", "-n", switch, "link", "set", "br0", "up"])
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{address} {host}\n" for host, address in self.addresses.items())
        for i, host in enumerate(self.hosts):
            ns = f"{self.prefix}-h{i}"
            self._namespaces[host] = ns
            netns.add_namespace(ns)
            # Created inside the switch namespace with its peer straight in the host's one,
            # so no interface ever appears in the root namespace.
            port = f"p{i}"
            netns.command(["ip", "-n", switch, "link", "add", port, "type", "veth",
                           "peer", "name", "eth0", "netns", ns])
            netns.command(["ip", "-n", switch, "link", "set", port, "master", "br0"])
            netns.command(["ip", "-n", switch, "link", "set", port, "up"])
            netns.command(["ip", "-n", ns, "addr", "add", f"{self.addresses[host]}/24",
                           "dev", "eth0"])
            netns.command(["ip", "-n", ns, "link", "set", "eth0", "up"])
            self._shape(ns, "eth0", self.bandwidth, self._burst, self._queue_latency)
            self._shape(switch, port, self.bandwidth, self._burst, self._queue_latency)
            netns.write_hosts_file(ns, hosts_file)
        self.agent = self._write_agent()

    def _write_agent(self) -> str:
        cases = "".join(f"  {host}) ns={ns} ;;\n" for host, ns in self._namespaces.items())
        script = (
            "#!/bin/sh\n"
            f"# rsh agent of emulated cluster {self.prefix}: `agent HOST COMMAND...` runs\n"
            "# COMMAND on HOST (its namespace, its hostname), as `ssh HOST COMMAND...` would.\n"
            'host="$1"; shift\n'
            'case "$host" in\n'
            f"{cases}"
            '  *) echo "emulated cluster: unknown host \'$host\'" >&2; exit 255 ;;\n'
            "esac\n"
            'exec ip netns exec "$ns" unshare --uts sh -c "hostname $host && $*"\n')
        assert self._lock is not None
        path = os.path.join(self._lock.state_dir, "rsh-agent.sh")
        with open(path, "w") as f:
            f.write(script)
        os.chmod(path, 0o755)
        return path

    def mpirun_args(self, slots_per_host: int = 1) -> list[str]:
        """``mpirun`` argv prefix that starts one rank per slot on every host (append the
        program). Run it with :meth:`run` (on host0)."""
        return [find_mpirun(), *self._root_args(),
                "-np", str(slots_per_host * len(self.hosts)),
                "-H", ",".join(f"{host}:{slots_per_host}" for host in self.hosts),
                "--bind-to", "none",
                "--mca", "plm_rsh_agent", self.agent,
                "--mca", "pml", "ob1", "--mca", "btl", "self,sm,tcp",
                "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0"]

    def launcher_args(self, slots_per_host: int = 1) -> list[str]:
        """``tfposeidon-run`` arguments (after the program name, before the command) that
        launch one rank per slot on every host. Run the launcher with :meth:`run`."""
        return ["-np", str(slots_per_host * len(self.hosts)),
                "-H", ",".join(f"{host}:{slots_per_host}" for host in self.hosts),
                "--network-interfaces", "eth0",
                "--mpi-args", f"--mca plm_rsh_agent {self.agent}"]

    def cut_link(self, host: str) -> None:
        """Takes ``host``'s ``eth0`` down (a pulled cable): it can no longer reach any host."""
        netns.command(["ip", "-n", self.namespace(host), "link", "set", "eth0", "down"])


class ShapedLoopback(_NamespacedCluster):
    """One namespace whose loopback is shaped to ``bandwidth``; all ranks share it.

    Same interface as EmulatedCluster with a single host ("host0"): MPI traffic goes over
    TCP on the shaped ``lo`` (shared memory is turned off). Cheaper, but every rank shares
    one link, unlike real hosts.
    """

    def __init__(self, bandwidth: str | None = "1gbit", *, burst: str = "128kb",
                 queue_latency: str = "50ms") -> None:
        super().__init__()
        self.hosts = ["host0"]
        self.bandwidth = bandwidth
        self._burst = burst
        self._queue_latency = queue_latency

    def _build(self) -> None:
        ns = f"{self.prefix}-h0"
        self._namespaces["host0"] = ns
        netns.add_namespace(ns)
        self._shape(ns, "lo", self.bandwidth, self._burst, self._queue_latency)
        netns.write_hosts_file(ns, "127.0.0.1 localhost host0\n")

    def mpirun_args(self, slots_per_host: int = 1) -> list[str]:
        """``mpirun`` argv prefix that starts ``slots_per_host`` ranks talking over ``lo``."""
        return [find_mpirun(), *self._root_args(), "-np", str(slots_per_host),
                "--oversubscribe", "--bind-to", "none",
                "--mca", "pml", "ob1", "--mca", "btl", "self,tcp",
                "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo"]

    def launcher_args(self, slots_per_host: int = 1) -> list[str]:
        """``tfposeidon-run`` arguments that start ``slots_per_host`` ranks over ``lo``."""
        return ["-np", str(slots_per_host), "--mpi-args",
                "--mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include lo "
                "--mca oob_tcp_if_include lo"]

    def cut_link(self, host: str) -> None:
        """Takes the namespace's ``lo`` down: every rank loses every peer."""
        netns.command(["ip", "-n", self.namespace(host), "link", "set", "lo", "down"])
