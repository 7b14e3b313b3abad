"""Network-namespace plumbing for the emulated clusters: commands, ownership, cleanup.

Everything a test cluster creates is named ``tpc-<8 hex>-<suffix>`` (the *run prefix*), so
that parallel runs never collide and a crashed run's leftovers can be found and removed.
Ownership is proved by a lock: a run holds ``flock`` on ``/run/tf_poseidon-netns/<prefix>.lock``
for its whole life, taken *before* it creates anything. :func:`sweep_leftovers` removes the
namespaces, ``/etc/netns`` entries and state directories of prefixes whose lock nobody holds
(the run died without tearing down, e.g. SIGKILL); it never touches a live run's objects.

Every function here is blocking, runs only ``ip``/``tc``-style commands with a timeout, and
raises :class:`NetnsError` with the command's own error message on failure.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from typing import Iterator, Sequence

STATE_DIR = "/run/tf_poseidon-netns"
ETC_NETNS = "/etc/netns"
COMMAND_TIMEOUT_S = 20.0
_PREFIX_RE = re.compile(r"^(tpc-[0-9a-f]{8})(?:-|\.lock$|$)")


class NetnsError(RuntimeError):
    """A namespace, link or qdisc command failed or timed out."""


def command(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S) -> str:
    """Runs ``argv`` to completion (at most ``timeout`` s) and returns its stdout.

    Raises NetnsError naming the command and quoting its stderr if it fails or times out.
    """
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{' '.join(argv)}` did not finish within {timeout:g} s") from None
    except FileNotFoundError:
        raise NetnsError(f"`{argv[0]}` is not installed (needed for `{' '.join(argv)}`)") from None
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed (exit {done.returncode}): "
                         f"{done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in command(["ip", "netns", "list"]).splitlines()
            if line.strip()]


def add_namespace(name: str) -> None:
    """Creates namespace ``name`` with its loopback up."""
    command(["ip", "netns", "add", name])
    command(["ip", "-n", name, "link", "set", "lo", "up"])


def namespace_pids(name: str) -> list[int]:
    """Pids of the processes living in namespace ``name`` (empty if it is gone)."""
    try:
        out = command(["ip", "netns", "pids", name])
    except NetnsError:
        return []
    return [int(p) for p in out.split()]


def kill_namespace_processes(names: Sequence[str], grace_s: float = 3.0) -> None:
    """Ends every process inside the namespaces ``names``: SIGTERM, then SIGKILL after ``grace_s``.

    Only processes inside namespaces this package created are touched. Blocks at most about
    ``grace_s`` + 1 s.
    """
    pids = [pid for name in names for pid in namespace_pids(name)]
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = [pid for pid in pids if _alive(pid)]
    _signal_all(pids, signal.SIGKILL)
    deadline = time.monotonic() + 1.0
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = [pid for pid in pids if _alive(pid)]


def _signal_all(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _alive(pid: int) -> bool:
    """False once ``pid`` has exited, including as a zombie not reaped yet (its parent, maybe
    a subprocess.Popen of ours, reaps it and keeps its exit status)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def delete_namespace(name: str) -> None:
    """Deletes namespace ``name`` (its links, bridges and qdiscs go with it) and its
    ``/etc/netns/<name>`` directory. Missing objects are not an error."""
    if name in list_namespaces():
        command(["ip", "netns", "del", name])
    shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(ETC_NETNS)  # only succeeds when empty: other runs' entries stay


def write_hosts_file(namespace: str, text: str) -> None:
    """Writes the /etc/hosts that ``ip netns exec <namespace>`` bind-mounts over /etc/hosts."""
    directory = os.path.join(ETC_NETNS, namespace)
    for _ in range(3):  # another run may rmdir an empty /etc/netns between our two steps
        try:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "hosts"), "w") as f:
                f.write(text)
            return
        except FileNotFoundError:
            continue
    raise NetnsError(f"could not create {directory}/hosts")


class RunLock:
    """Proof that a run prefix is alive: an exclusive flock held from creation to teardown.

    Created by the cluster before any namespace; released by :meth:`release` after all of
    them are deleted. ``state_dir`` is a private directory for the run's files (scripts).
    """

    def __init__(self) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        self.prefix = f"tpc-{secrets.token_hex(4)}"
        self._path = os.path.join(STATE_DIR, f"{self.prefix}.lock")
        # Locked under a name sweepers ignore, then renamed: the lock file never exists unlocked.
        hidden = os.path.join(STATE_DIR, f".new-{self.prefix}")
        self._fd = os.open(hidden, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.rename(hidden, self._path)
        self.state_dir = os.path.join(STATE_DIR, self.prefix)
        os.makedirs(self.state_dir)

    def release(self) -> None:
        """Removes the state directory and the lock file, then drops the lock. Idempotent."""
        if self._fd < 0:
            return
        shutil.rmtree(self.state_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        os.close(self._fd)
        self._fd = -1


def sweep_leftovers() -> list[str]:
    """Removes everything left by dead runs (prefixes whose lock is not held); returns the
    prefixes removed. Kills processes still inside those namespaces. Safe while other runs
    are alive: their locks are held, so their objects are skipped."""
    names = list_namespaces()
    etc = os.listdir(ETC_NETNS) if os.path.isdir(ETC_NETNS) else []
    state = os.listdir(STATE_DIR) if os.path.isdir(STATE_DIR) else []
    prefixes = {m.group(1) for entry in names + etc + state if (m := _PREFIX_RE.match(entry))}
    removed = []
    for prefix in sorted(prefixes):
        lock_path = os.path.join(STATE_DIR, f"{prefix}.lock")
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:
            fd = -1  # never locked or already released: nobody owns these objects
        try:
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live run
            mine = [n for n in names if n.startswith(prefix + "-")]
            kill_namespace_processes(mine)
            for name in mine:
                delete_namespace(name)
            for entry in etc:
                if entry.startswith(prefix + "-"):
                    shutil.rmtree(os.path.join(ETC_NETNS, entry), ignore_errors=True)
            shutil.rmtree(os.path.join(STATE_DIR, prefix), ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)
            removed.append(prefix)
        finally:
            if fd >= 0:
                os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(ETC_NETNS)
    return removed


@contextlib.contextmanager
def signals_become_exceptions() -> Iterator[None]:
    """While active (main thread only), SIGTERM and SIGHUP raise SystemExit like Ctrl-C raises
    KeyboardInterrupt, so ``finally`` blocks run. Handlers the program installed itself are
    left alone. Elsewhere than the main thread this is a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, _raise_system_exit)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """While active (main thread only), SIGINT/SIGTERM/SIGHUP are recorded instead of acted
    on, so a teardown cannot be interrupted half-way; the first one recorded is raised again
    (to whatever handler is then installed) when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if received:
            signal.raise_signal(received[0])
