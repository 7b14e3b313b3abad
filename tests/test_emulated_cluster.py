"""Emulated multi-host clusters: a real 2-host MPI job through tfposeidon-run, link failure,
and teardown that leaves nothing behind (also after exceptions, SIGTERM and SIGKILL)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tf_poseidon.testing import EmulatedCluster, ShapedLoopback, available, netns

ok, why = available()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(not ok, reason=why)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALLREDUCE = textwrap.dedent("""
    import socket
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    x = np.full(1 << 20, comm.rank + 1, np.float32)   # 4 MB
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    print(f"rank {comm.rank} host {socket.gethostname()} sum {y[0]:g} ok {bool((y == y[0]).all())}",
          flush=True)
""")


def root_links():
    return netns.command(["ip", "-o", "link", "show"]).count("\n")


def leftovers(prefix):
    """Every trace of a cluster's prefix still on the machine."""
    found = [n for n in netns.list_namespaces() if n.startswith(prefix)]
    if os.path.isdir(netns.ETC_NETNS):
        found += [f"/etc/netns/{e}" for e in os.listdir(netns.ETC_NETNS) if e.startswith(prefix)]
    found += [f"{netns.STATE_DIR}/{e}" for e in os.listdir(netns.STATE_DIR) if e.startswith(prefix)]
    return found


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "allreduce.py"
    path.write_text(ALLREDUCE)
    return str(path)


@pytest.mark.multirank
def test_two_hosts_allreduce_via_launcher_then_link_cut_and_clean_teardown(script):
    links_before = root_links()
    with EmulatedCluster(2, "1gbit") as cluster:
        prefix = cluster.prefix
        done = cluster.run([sys.executable, "-m", "tf_poseidon.launcher", "--verbose",
                            *cluster.launcher_args(), sys.executable, script], timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        ranks = sorted(l.split() for l in done.stdout.splitlines() if l.startswith("rank"))
        assert [r[1] for r in ranks] == ["0", "1"]
        assert [r[3] for r in ranks] == ["host0", "host1"]  # one rank per emulated host
        assert all(r[5] == "3" and r[7] == "True" for r in ranks)  # 1 + 2 everywhere

        cluster.cut_link("host1")
        done = cluster.run([*cluster.mpirun_args(), sys.executable, script], timeout=30)
        # host1's daemon cannot call mpirun back: the launch fails at once, naming it
        assert done.returncode != 0 and "Remote host:   host1" in done.stdout + done.stderr
        assert prefix + "-sw" in netns.list_namespaces()
    assert leftovers(prefix) == []
    assert root_links() == links_before  # nothing was ever added to the root namespace


def test_teardown_after_exception_in_body():
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(3, None) as cluster:
            prefix = cluster.prefix
            assert len([n for n in netns.list_namespaces() if n.startswith(prefix)]) == 4
            raise RuntimeError("boom")
    assert leftovers(prefix) == []


@pytest.mark.multirank
def test_shaped_loopback_allreduce(script):
    with ShapedLoopback("1gbit") as lo:
        done = lo.run([*lo.mpirun_args(slots_per_host=2), sys.executable, script], timeout=60)
        prefix = lo.prefix
    assert done.returncode == 0, done.stderr[-3000:]
    sums = [line.split()[5] for line in done.stdout.splitlines() if line.startswith("rank")]
    assert sums == ["3", "3"]
    assert leftovers(prefix) == []


OWNER = textwrap.dedent("""
    import os, signal, sys, time
    from tf_poseidon.testing.emulated_cluster import EmulatedCluster
    with EmulatedCluster(2, "1gbit") as cluster:
        # a process on host1 that the teardown has to end
        cluster.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 &"], host="host1", timeout=10)
        print(cluster.prefix, flush=True)
        time.sleep(120)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killed_owner_leaves_nothing_behind(sig):
    """SIGTERM: the owner tears down itself. SIGKILL: the next cluster removes the leftovers."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             cwd=ROOT)
    try:
        prefix = owner.stdout.readline().strip()
        assert prefix.startswith("tpc-"), "the owner did not build its cluster"
        assert leftovers(prefix)
        owner.send_signal(sig)
        owner.wait(timeout=30)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    if sig == signal.SIGKILL:
        assert leftovers(prefix), "SIGKILL cannot be caught: objects are expected to remain"
        with EmulatedCluster(1, None):
            pass
    assert leftovers(prefix) == []
