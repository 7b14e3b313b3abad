"""tfposeidon-run: argument parsing, the mpirun command it builds, host checks, real runs."""

import os
import shlex
import subprocess
import sys
import textwrap
import time

import pytest

from tf_poseidon import launcher, world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plan(*argv, environ=None):
    args = launcher.parse_args(launcher.make_parser(), argv)
    return launcher.plan(args, {"PATH": "/usr/bin"} if environ is None else environ)


def mca(argv, name):
    """The value of `--mca name value` in argv, or None."""
    for flag, key, value in zip(argv, argv[1:], argv[2:]):
        if flag == "--mca" and key == name:
            return value
    return None


def test_local_run_command():
    p = plan("-np", "2", "python", "train.py", "--epochs", "3")
    assert p.argv[0] == launcher.find_mpirun()
    assert p.argv[-3:] == ["train.py", "--epochs", "3"] and p.argv[-4] == "python"
    assert p.argv[p.argv.index("-np") + 1] == "2"
    assert p.argv[p.argv.index("--bind-to") + 1] == "none"
    for name, value in world.OPEN_MPI_DEFAULTS.items():
        assert mca(p.argv, name) == value
    assert "put" not in mca(p.argv, "btl_tcp_flags").split(",")
    # Each rank sets the all-reduce rules itself, with its own copy's path (world.mpi_comm).
    assert not any(arg.startswith("coll_tuned_") for arg in p.argv)
    assert "-H" not in p.argv and mca(p.argv, "btl") is None  # local: Open MPI's defaults
    assert p.remote_hosts == []


def test_mpirun_is_this_environments():
    assert os.path.dirname(launcher.find_mpirun()) == os.path.dirname(sys.executable)


def test_two_machines_over_ssh():
    p = plan("-np", "4", "-H", "server1:2,server2:2", "-p", "2222", "-i", "/k/id",
             "--start-timeout", "12", "--network-interfaces", "eth1", "python", "train.py")
    assert p.argv[p.argv.index("-H") + 1] == "server1:2,server2:2"
    assert mca(p.argv, "pml") == "ob1" and mca(p.argv, "btl") == "self,sm,tcp"
    assert mca(p.argv, "btl_tcp_if_include") == "eth1"
    assert mca(p.argv, "oob_tcp_if_include") == "eth1"
    ssh = shlex.split(mca(p.argv, "plm_rsh_args"))
    assert ssh == ["-o", "BatchMode=yes", "-o", "ConnectTimeout=12", "-p", "2222", "-i", "/k/id"]
    assert p.remote_hosts == ["server1", "server2"]
    assert p.agent == ["ssh", *ssh] and p.start_timeout == 12
    prte = {value for flag, value in zip(p.argv, p.argv[1:]) if flag == "--prtemca"}
    assert prte == set(launcher.KEEPALIVE)  # a lost host is noticed in seconds
    assert p.argv[-2:] == ["python", "train.py"]


def test_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the cluster\nserver1 slots=4\n\nserver2   slots=2  # small\nserver3\n")
    assert launcher.parse_hostfile(str(hostfile)) == [
        launcher.Host("server1", 4), launcher.Host("server2", 2), launcher.Host("server3", 1)]
    p = plan("--hostfile", str(hostfile), "python", "train.py")
    assert p.argv[p.argv.index("-np") + 1] == "7"  # default -np: all slots
    assert p.argv[p.argv.index("-H") + 1] == "server1:4,server2:2,server3:1"
    hostfile.write_text("server1 slots=4\nserver2 max_slots=2\n")
    with pytest.raises(launcher.LaunchError, match=r"hosts:2: expected `host slots=N`"):
        launcher.parse_hostfile(str(hostfile))
    hostfile.write_text("server1 slots=4\n-oProxyCommand=sh slots=1\n")
    with pytest.raises(launcher.LaunchError, match=r"hosts:2: '-oProxyCommand=sh' is not a host"):
        launcher.parse_hostfile(str(hostfile))


@pytest.mark.parametrize("argv, message", [
    (["-np", "5", "-H", "a:2,b:2", "python", "x.py"], "more than the 4 slots"),
    (["python", "x.py"], "give the number of processes"),
    (["-np", "2"], "no command given"),
    (["-H", "a:0", "python", "x.py"], "slots must be a positive integer"),
    (["-np", "2", "--start-timeout", "0", "python", "x.py"], "start-timeout must be positive"),
    (["-np", "0", "python", "x.py"], "-np must be >= 1, got 0"),
    (["-np", "-2", "-H", "a:2", "python", "x.py"], "-np must be >= 1, got -2"),
    # A host name is never an ssh option (ssh would run the proxy command).
    (["-np", "2", "-H", "a:1,-oProxyCommand=touch /tmp/pwned", "python", "x.py"],
     r"'-oProxyCommand=touch /tmp/pwned' is not a host name"),
    (["-np", "2", "-H", "a b:1", "python", "x.py"], r"'a b' is not a host name"),
    (["-np", "2", "-x", "1BAD", "python", "x.py"], r"'1BAD' is not an environment variable"),
    (["-np", "2", "-x", "NOT_SET_HERE", "python", "x.py"],
     "NOT_SET_HERE is not set in this environment"),
])
def test_bad_command_lines(argv, message):
    with pytest.raises(launcher.LaunchError, match=message):
        plan(*argv)


def test_bad_command_line_exit_status(capsys):
    assert launcher.main(["python", "x.py"]) == 2
    assert "give the number of processes with -np N" in capsys.readouterr().err


def test_oversubscribe_only_when_more_ranks_than_cores(monkeypatch):
    monkeypatch.setattr(launcher, "_physical_cores", lambda: 2)
    assert "--oversubscribe" not in plan("-np", "2", "python", "x.py").argv
    assert "--oversubscribe" in plan("-np", "3", "python", "x.py").argv
    # With hosts, the slots given are what Open MPI fills; more ranks than slots is an error.
    assert "--oversubscribe" not in plan("-np", "8", "-H", "a:8", "python", "x.py").argv


def test_root_and_non_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    p = plan("-np", "2", "python", "x.py")
    assert "--allow-run-as-root" in p.argv
    assert p.env["OMPI_ALLOW_RUN_AS_ROOT"] == p.env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    p = plan("-np", "2", "python", "x.py")
    assert "--allow-run-as-root" not in p.argv and "OMPI_ALLOW_RUN_AS_ROOT" not in p.env


def exported(argv):
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]


def test_environment_forwarding_and_timeline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    environ = {"PATH": "/usr/bin", "PYTHONPATH": "/src", "TF_CPP_MIN_LOG_LEVEL": "2",
               "TF_POSEIDON_INTRA_THREADS": "1", "OMPI_MCA_btl_tcp_if_exclude": "docker0",
               "CUDA_VISIBLE_DEVICES": "0", "HOME": "/root", "AWS_SECRET_ACCESS_KEY": "x",
               "TF_CONFIG": '{"cluster": {}}', "TF_MY_TOKEN": "secret", "NCCL_DEBUG": "INFO",
               "WANDB_API_KEY": "k", "DATA_DIR": "/data"}
    p = plan("-np", "2", "--timeline-filename", "tl.json", "python", "x.py", environ=environ)
    # The documented list only: not every TF_* (TF_CONFIG would describe another job), no
    # secrets, nothing the ranks do not read.
    assert set(exported(p.argv)) == {
        "PATH", "PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", "TF_POSEIDON_INTRA_THREADS",
        "OMPI_MCA_btl_tcp_if_exclude", "CUDA_VISIBLE_DEVICES", "TF_POSEIDON_TIMELINE"}
    # -x adds a variable of this environment (once, even if forwarded anyway) or sets one.
    extra = plan("-np", "2", "-x", "DATA_DIR", "-x", "PATH", "-x", "NCCL_DEBUG=WARN", "python",
                 "x.py", environ=environ)
    assert exported(extra.argv) == ["CUDA_VISIBLE_DEVICES", "OMPI_MCA_btl_tcp_if_exclude",
                                    "PATH", "PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL",
                                    "TF_POSEIDON_INTRA_THREADS", "DATA_DIR", "NCCL_DEBUG=WARN"]
    assert extra.argv[-2:] == ["python", "x.py"]
    assert p.env["TF_POSEIDON_TIMELINE"] == str(tmp_path / "tl.json")
    # The ranks' `python` is the launcher's own.
    assert p.env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)


def test_custom_agent_and_extra_mpi_args():
    p = plan("-np", "2", "-H", "host0:1,host1:1", "--mpi-args",
             "--mca plm_rsh_agent '/run/x/agent.sh' --report-bindings",
             "--", "python", "-c", "print(1)")
    assert p.agent == ["/run/x/agent.sh"] and mca(p.argv, "plm_rsh_args") is None
    tail = p.argv[p.argv.index("--report-bindings"):]
    assert tail == ["--report-bindings", "python", "-c", "print(1)"]


def test_dry_run_prints_the_command(capsys):
    assert launcher.main(["-np", "3", "--dry-run", "python", "train.py"]) == 0
    printed = shlex.split(capsys.readouterr().out.strip())
    assert printed[0] == launcher.find_mpirun() and printed[-2:] == ["python", "train.py"]


def test_reachability_check_names_failing_and_silent_hosts():
    agent = ["sh", "-c", 'case "$0" in good*) exit 0 ;; slow) sleep 20 ;; '
             '*) echo "no route to $0" >&2; exit 255 ;; esac']
    start = time.monotonic()
    failures = launcher.check_reachable(["good1", "bad", "slow", "good2"], agent, timeout=1.5)
    assert time.monotonic() - start < 5
    assert len(failures) == 2
    assert failures[0].startswith("bad:") and "no route to bad" in failures[0]
    assert failures[1].startswith("slow: no answer within the start timeout (1.5 s)")


def test_ssh_check_ends_options_before_the_host(tmp_path):
    # A stand-in `ssh` that records its arguments: the host comes after `--`.
    ssh = tmp_path / "ssh"
    ssh.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path}/argv\n")
    ssh.chmod(0o755)
    p = plan("-np", "2", "-H", "server1:1,server2:1", "python", "x.py")
    agent = [str(ssh), *p.agent[1:]]
    assert launcher.check_reachable(["server2"], agent, timeout=10) == []
    assert (tmp_path / "argv").read_text().split("\n")[:-1] == [
        "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "--", "server2", "true"]


def test_host_name_that_is_an_option_is_refused_before_anything_runs(tmp_path, capsys):
    marker = tmp_path / "pwned"
    code = launcher.main(["-np", "2", "-H", f"a:1,-oProxyCommand=touch {marker}", "python",
                          "x.py"])
    assert code == 2 and not marker.exists()
    assert "is not a host name" in capsys.readouterr().err


def test_unreachable_host_prevents_launch(tmp_path, capsys):
    agent = tmp_path / "agent.sh"
    agent.write_text("#!/bin/sh\necho \"ssh: connect to host $1: Connection refused\" >&2\n"
                     "exit 255\n")
    agent.chmod(0o755)
    code = launcher.main(["-np", "2", "-H", "nosuchhost1:1,nosuchhost2:1", "--mpi-args",
                          f"--mca plm_rsh_agent {agent}", "python", "-c", "print(1)"])
    assert code == 1
    err = capsys.readouterr().err
    assert "cannot reach every host" in err and "nosuchhost2: `" in err
    assert "Connection refused" in err


# The start of a rank's script: world.py loaded on its own, as ``world`` (importing the
# tf_poseidon package would load TensorFlow).
WORLD_ONLY = textwrap.dedent(f"""
    import importlib.util, os, sys
    spec = importlib.util.spec_from_file_location(
        "world_only", {os.path.join(ROOT, "tf_poseidon", "world.py")!r})
    world = importlib.util.module_from_spec(spec)
    sys.modules["world_only"] = world
    spec.loader.exec_module(world)
""")

RANK_SCRIPT = textwrap.dedent("""
    w = world.detect_world()
    print(f"rank {{w.rank}} of {{w.size}} local {{w.local_rank}}/{{w.local_size}} {{w.launcher}}",
          flush=True)
    sys.exit({exit_code} if w.rank == 1 else 0)
""")


def rank_script(exit_code=0):
    return WORLD_ONLY + RANK_SCRIPT.format(exit_code=exit_code)


@pytest.mark.multirank
def test_real_local_run_prints_ranks():
    done = subprocess.run([sys.executable, "-m", "tf_poseidon.launcher", "-np", "2", "--verbose",
                           "python", "-c", rank_script()],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "--bind-to none" in lines[0]  # --verbose: the mpirun command comes first
    assert sorted(l for l in lines if l.startswith("rank")) == [
        "rank 0 of 2 local 0/2 openmpi", "rank 1 of 2 local 1/2 openmpi"]


@pytest.mark.multirank
def test_failing_rank_fails_the_launch(capfd):
    assert launcher.main(["-np", "2", sys.executable, "-c", rank_script(exit_code=3)]) != 0


@pytest.mark.multirank
def test_mpi_without_thread_multiple_is_refused():
    # A program that initialised MPI itself at a lower thread level: tf_poseidon's engine
    # thread would share MPI with a main thread that may abort or finalize it.
    script = WORLD_ONLY + textwrap.dedent("""
        import mpi4py
        mpi4py.rc.thread_level = "serialized"
        from mpi4py import MPI
        world.mpi_comm()
    """)
    done = subprocess.run([sys.executable, "-m", "tf_poseidon.launcher", "-np", "2",
                           sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode != 0
    assert ("WorldError: MPI runs with thread support MPI_THREAD_SERIALIZED; tf_poseidon needs "
            "MPI_THREAD_MULTIPLE") in done.stderr, done.stderr[-3000:]


def test_users_own_mca_settings_win():
    """Open MPI refuses a parameter given twice; the user's --mpi-args or OMPI_MCA_* win."""
    p = plan("-np", "2", "-H", "a:1,b:1", "--mpi-args", "--mca pml ucx --bind-to core",
             "python", "x.py", environ={"PATH": "/usr/bin", "OMPI_MCA_btl": "self,tcp",
                                        "OMPI_MCA_btl_tcp_flags": "send,put"})
    assert p.argv.count("--bind-to") == 1 and p.argv[p.argv.index("--bind-to") + 1] == "core"
    assert [a for a in p.argv if a in ("pml", "btl")] == ["pml"]  # only the user's pml
    assert p.argv[p.argv.index("pml") + 1] == "ucx"
    assert mca(p.argv, "btl_tcp_flags") is None  # the user's variable reaches the ranks


@pytest.mark.parametrize("user, rules", [
    (set(), True),
    ({"btl_tcp_flags", "coll_tuned_priority", "coll_tuned_verbose"}, True),
    ({"coll_tuned_use_dynamic_rules"}, False),
    ({"coll_tuned_dynamic_rules_filename"}, False),
    ({"coll_tuned_allreduce_algorithm"}, False),  # forced: a rules file would override it
    ({"coll_tuned_bcast_algorithm_segmentsize"}, False),
])
def test_the_allreduce_rules_are_installed_unless_the_user_chose_algorithms(user, rules):
    chosen = world.open_mpi_defaults(user, 4)
    assert {k: v for k, v in chosen.items() if k in world.OPEN_MPI_DEFAULTS} == {
        k: v for k, v in world.OPEN_MPI_DEFAULTS.items() if k not in user}
    assert (chosen.items() >= world.COLLECTIVE_RULES.items()) == rules
    assert rules or not set(chosen) & set(world.COLLECTIVE_RULES)
    assert os.path.isfile(world.ALLREDUCE_RULES)


@pytest.mark.parametrize("size, user, ring", [
    (2, set(), True), (3, set(), True), (4, set(), False), (64, set(), False),
    (3, {"coll_libnbc_iallreduce_algorithm"}, False),
    (3, {"coll_tuned_allreduce_algorithm"}, True),  # the blocking component's, not libnbc's
])
def test_non_blocking_all_reduces_take_the_ring_below_four_ranks_unless_set(size, user, ring):
    chosen = world.open_mpi_defaults(user, size)
    assert (chosen.get("coll_libnbc_iallreduce_algorithm") == "1") == ring
    assert ring or "coll_libnbc_iallreduce_algorithm" not in chosen


def read_classic_rules(path):
    """Open MPI's classic rules file as {collective id: {comm size: [(bytes, alg, topo, segs,
    reqs)]}}, refusing what its reader would not take: counts that do not match, message sizes
    not ascending from 0, comm sizes not ascending."""
    with open(path) as f:
        lines = [line.split("#")[0].split() for line in f]
    assert lines[0] == ["rule-file-version-2"]
    numbers = iter(int(word) for line in lines[1:] for word in line)
    rules = {}
    for _ in range(next(numbers)):
        collective, sizes = next(numbers), {}
        for _ in range(next(numbers)):
            comm_size, count = next(numbers), next(numbers)
            sizes[comm_size] = [tuple(next(numbers) for _ in range(5)) for _ in range(count)]
            message_sizes = [rule[0] for rule in sizes[comm_size]]
            assert message_sizes[0] == 0 and message_sizes == sorted(set(message_sizes))
        assert list(sizes) == sorted(sizes)
        rules[collective] = sizes
    assert next(numbers, None) is None, "numbers left over after the last rule"
    return rules


def test_the_allreduce_rules_file_takes_the_ring_from_three_ranks_and_256_kib():
    """Open MPI reads the file silently: a malformed one is ignored without a word, so its
    shape is checked here (collective 2 is MPI_Allreduce; algorithm 0 is Open MPI's own
    choice, 4 the ring)."""
    rules = read_classic_rules(world.ALLREDUCE_RULES)
    assert rules == {2: {2: [(0, 0, 0, 0, 0)],
                         3: [(0, 0, 0, 0, 0), (256 << 10, 4, 0, 0, 0)]}}


@pytest.mark.multirank
@pytest.mark.parametrize("environ, expected, rules", [
    ({}, world.OPEN_MPI_DEFAULTS["btl_tcp_flags"], True),
    ({"OMPI_MCA_btl_tcp_flags": "send,put,inplace"}, "send,put,inplace", True),
    ({"OMPI_MCA_coll_tuned_use_dynamic_rules": "0"}, world.OPEN_MPI_DEFAULTS["btl_tcp_flags"],
     False),
])
def test_ranks_under_plain_mpirun_get_the_open_mpi_defaults_unless_set(environ, expected, rules):
    """mpi_comm() sets open_mpi_defaults() before MPI starts, for jobs not started by
    tfposeidon-run; a value the user set (here through mpirun's environment) is kept."""
    script = WORLD_ONLY + textwrap.dedent("""
        comm = world.mpi_comm()
        rules = os.environ.get("OMPI_MCA_coll_tuned_dynamic_rules_filename", "")
        print("rank", comm.Get_rank(), os.environ["OMPI_MCA_btl_tcp_flags"],
              os.path.isfile(rules), os.environ["OMPI_MCA_coll_libnbc_iallreduce_algorithm"],
              flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA_")} | environ
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    done = subprocess.run([launcher.find_mpirun(), *root, "-np", "2", "--oversubscribe",
                           "--bind-to", "none", sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("rank")) == [
        f"rank 0 {expected} {rules} 1", f"rank 1 {expected} {rules} 1"]  # 2 ranks: the ring


def test_inside_slurm_allocation_no_ssh():
    p = plan("-np", "2", "-H", "node1:1,node2:1", "python", "x.py",
             environ={"PATH": "/usr/bin", "SLURM_JOB_ID": "77"})
    assert p.remote_hosts == [] and mca(p.argv, "plm_rsh_args") is None


@pytest.mark.parametrize("body, expected", [
    ("exec sleep 30", 128 + 15),                   # the job ends on the forwarded SIGTERM
    ("trap '' TERM; while :; do sleep 0.1; done", 128 + 15),  # ignored: killed after the grace
])
def test_sigterm_is_forwarded_then_enforced(monkeypatch, body, expected):
    import signal
    import threading
    monkeypatch.setattr(launcher, "SHUTDOWN_GRACE_S", 1.0)
    job = launcher.LaunchPlan(argv=["sh", "-c", body], env=dict(os.environ), remote_hosts=[],
                              agent=[], start_timeout=1.0)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    start = time.monotonic()
    assert launcher.run(job) == launcher.JobEnd(expected, True, [])
    assert time.monotonic() - start < 10


def test_output_held_open_by_a_leftover_child_does_not_hold_the_launcher(capfd):
    """A process mpirun started for a lost host (ssh, the remote daemon) can keep mpirun's
    pipes open long after mpirun exited; the launcher ends OUTPUT_DRAIN_S after mpirun."""
    body = f"sleep 60 & echo relayed; echo '{launcher.LOST_DAEMON.decode()}' >&2"
    job = launcher.LaunchPlan(argv=["sh", "-c", body], env=dict(os.environ), remote_hosts=[],
                              agent=[], start_timeout=1.0)
    start = time.monotonic()
    end = launcher.run(job)
    assert time.monotonic() - start < launcher.OUTPUT_DRAIN_S + 5
    assert end == launcher.JobEnd(1, False, ["Open MPI lost a host"])
    out, err = capfd.readouterr()
    assert "relayed" in out and launcher.LOST_DAEMON.decode() in err


def test_the_programs_own_flags_are_passed_through_untouched():
    parser = launcher.make_parser()
    args = launcher.parse_args(parser, ["-np", "2", "--verbose", "python", "train.py",
                                        "--verbose", "--n", "3", "-np", "7"])
    assert args.np == 2 and args.verbose
    assert args.command == ["python", "train.py", "--verbose", "--n", "3", "-np", "7"]
    args = launcher.parse_args(parser, ["-np", "2", "--", "--weird-program"])
    assert args.command == ["--weird-program"]


def test_restart_leaves_out_lost_hosts_down_to_min_np(tmp_path):
    agent = tmp_path / "agent.sh"
    agent.write_text('#!/bin/sh\ncase "$1" in lost*) echo "no route to $1" >&2; exit 255;; '
                     'esac\n')
    agent.chmod(0o755)
    argv = ["-np", "4", "-H", "good:2,lost:2", "--max-restarts", "1", "--mpi-args",
            f"--mca plm_rsh_agent {agent}", "python", "x.py"]
    args = launcher.parse_args(launcher.make_parser(), ["--min-np", "2", *argv])
    restart = launcher.replan(args, {"PATH": "/usr/bin"}, 1)
    assert restart.argv[restart.argv.index("-H") + 1] == "good:2"
    assert restart.argv[restart.argv.index("-np") + 1] == "2" and restart.num_ranks == 2
    assert restart.env["TF_POSEIDON_RESTART"] == "1" and "TF_POSEIDON_RESTART" in exported(
        restart.argv)
    args = launcher.parse_args(launcher.make_parser(), argv)  # --min-np defaults to -np
    with pytest.raises(launcher.LaunchError, match=r"lost cannot be reached; the hosts left "
                                                   r"have 2 slots, fewer than the 4 ranks"):
        launcher.replan(args, {"PATH": "/usr/bin"}, 1)


RESTART_SCRIPT = textwrap.dedent("""
    import os, sys, time
    restart = os.environ["TF_POSEIDON_RESTART"]
    rank = os.environ["OMPI_COMM_WORLD_RANK"]
    print(f"rank {rank} launch {restart}", flush=True)
    # Each launch of each rank is recorded in a file too: a rank that exits non-zero at once
    # can lose its last output line in mpirun's forwarding when the job is torn down.
    open(os.path.join("{marks}", f"rank {rank} launch {restart}"), "w").close()
    # Rank 1 fails only once rank 0 has printed: a failing rank makes mpirun stop the others.
    marker = os.path.join("{marks}", f"launch{restart}")
    if rank == "0":
        open(marker, "w").close()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
    sys.exit(3 if rank == "1" and int(restart) < {failures} else 0)
""")


@pytest.mark.multirank
@pytest.mark.parametrize("failures, status", [(1, 0), (5, 3)])
def test_max_restarts_starts_a_failed_job_again(capfd, tmp_path, failures, status):
    # Rank 1 exits 3 on the first `failures` launches; two restarts are allowed.
    script = RESTART_SCRIPT.replace("{failures}", str(failures)).replace("{marks}",
                                                                        str(tmp_path))
    code = launcher.main(["-np", "2", "--max-restarts", "2", sys.executable, "-c", script])
    out, err = capfd.readouterr()
    assert code == status
    launches = min(failures + 1, 3)
    assert sorted(p.name for p in tmp_path.glob("rank *")) == sorted(
        f"rank {r} launch {n}" for r in (0, 1) for n in range(launches))
    assert set(line for line in out.splitlines() if line.startswith("rank")) <= {
        f"rank {r} launch {n}" for r in (0, 1) for n in range(launches)}
    assert [line for line in err.splitlines() if "restarting" in line] == [
        f"tfposeidon-run: restarting the job (restart {n} of 2, 2 ranks) after exit status 3"
        for n in range(1, launches)]


@pytest.mark.parametrize("argv, message", [
    (["-np", "2", "--max-restarts", "-1", "python", "x.py"], "--max-restarts must be >= 0"),
    (["-np", "2", "--min-np", "3", "python", "x.py"], r"--min-np must be between 1 and the "
                                                      r"number of ranks \(2\), got 3"),
])
def test_bad_restart_flags(argv, message):
    with pytest.raises(launcher.LaunchError, match=message):
        plan(*argv)
