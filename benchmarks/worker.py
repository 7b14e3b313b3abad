"""One rank of a benchmark job. benchmarks/runner.py starts it (``python benchmarks/worker.py
--kind KIND --out DIR ...``, one process per rank); not run by hand.

Kinds:

- ``single``: Keras ``fit`` without any strategy: the compute-only reference. Under ``mpirun``
  it is P independent copies (no communication at all): what sharing the cores costs alone.
- ``poseidon``: ``tp.PoseidonStrategy(**options)`` and Keras ``fit`` on global batches of
  P × batch rows, as users write it. A NotImplementedError from the constructor is recorded as
  "not available" (every rank raises it alike, so the job ends cleanly).
- ``mwms``: TensorFlow's MultiWorkerMirroredStrategy (RING collectives over gRPC) with a custom
  loop (Keras 3 ``fit`` fails under it in TF 2.21, keras#20585); TF_CONFIG is built from
  ``--peers`` and this process's MPI rank.
- ``allreduce``: times all-reduces of ``--megabytes`` and of 1 KB of float32 per codec of
  ``--codecs``: ``mpi`` is mpi4py's ``Allreduce`` in a process that never imports tf_poseidon;
  a codec name (tf_poseidon.comm.codecs) is the engine's all-reduce through that codec.

The training kinds train ``--model`` (benchmarks/models.py) on synthetic data with SGD, no
metrics, and share one step clock (:class:`Clock`): a step ends when its loss is on the host
(Keras' ``on_train_batch_end``; ``.numpy()`` in the custom loop); the timed window runs from the
end of the last warm-up step to the end of the last step, and this host's ``--nic`` counters
(``/proc/net/dev`` of the process's network namespace: the emulated host's ``eth0``) are read at
the same moments. ``--straggler R --delay S --every N`` makes rank R sleep (``--spin``: busy-wait)
S seconds before steps N-1, 2N-1, ...; ``--straggler moving`` slows rank 0 the first time, rank 1
the next, and so on.

Every rank writes ``DIR/rank<r>.json`` (atomically, last); rank 0 appends progress lines to
``DIR/progress``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

if __package__ in (None, ""):
    # Started as a file: make the ``benchmarks`` package importable by appending the repository
    # root after everything else (an installed tf_poseidon is not shadowed by the checkout's),
    # and drop this directory (its module names are generic).
    _HERE = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
        del sys.path[0]
    sys.path.append(os.path.dirname(_HERE))

_T0 = time.perf_counter()


def mpi_rank() -> tuple[int, int]:
    """(rank, size) from Open MPI's environment; (0, 1) without a launcher."""
    env = os.environ
    return int(env.get("OMPI_COMM_WORLD_RANK", 0)), int(env.get("OMPI_COMM_WORLD_SIZE", 1))


def nic_counters(nic: str | None) -> tuple[int, int] | None:
    """(rx_bytes, tx_bytes) of ``nic`` in this process's network namespace, or None."""
    if nic:
        with open("/proc/self/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == nic:
                    fields = rest.split()
                    return int(fields[0]), int(fields[8])
    return None


class Clock:
    """The step clock of one rank: step-end times and NIC counters, the straggler's delay, and
    the result file. Called from the training thread only."""

    def __init__(self, args: argparse.Namespace, rank: int, size: int):
        self.args, self.rank, self.size = args, rank, size
        self.ends: list[float] = []
        self.counters: list[tuple[int, int] | None] = []
        self.start = time.perf_counter()

    def progress(self, text: str) -> None:
        if self.rank == 0:
            with open(os.path.join(self.args.out, "progress"), "a") as f:
                f.write(text + "\n")

    def begin(self) -> None:
        self.start = time.perf_counter()
        self.progress(f"set up in {self.start - _T0:.1f} s; training")

    def before_step(self, step: int) -> None:
        """The straggler's delay, if this rank is slowed before ``step`` (0-based)."""
        a = self.args
        if a.straggler is None or step % a.every != a.every - 1:
            return
        slowed = (step // a.every) % self.size if a.straggler == "moving" else int(a.straggler)
        if slowed == self.rank:
            until = time.perf_counter() + a.delay
            while a.spin and time.perf_counter() < until:
                pass
            time.sleep(max(0.0, until - time.perf_counter()))

    def after_step(self) -> None:
        """Called once per step, after the step's loss reached the host."""
        self.ends.append(time.perf_counter())
        self.counters.append(nic_counters(self.args.nic))
        done, w = len(self.ends), self.args.warmup
        last = self.ends[-1] - (self.ends[-2] if done > 1 else self.start)
        self.progress(f"step {done}/{w + self.args.steps} "
                      f"({'warm-up' if done <= w else 'timed'}) {last:.2f} s")

    def write(self, status: str = "ok", message: str = "", **extra) -> None:
        """Writes this rank's result: the timed figures (status "ok") and ``extra``."""
        a = self.args
        result = {"kind": a.kind, "model": a.model, "rank": self.rank, "size": self.size,
                  "host": socket.gethostname(), "status": status, "message": message,
                  "batch": a.batch, "warmup": a.warmup,
                  "affinity_cpus": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg()[0]}
        if status == "ok" and self.ends:
            w = a.warmup  # >= 1: the first step traces and builds; it is never timed
            if len(self.ends) < w + 1:
                raise RuntimeError(f"only {len(self.ends)} steps ran; {w} warm-up + 1 needed")
            first, timed = self.ends[w - 1], self.ends[w:]
            result.update(steps=len(timed), window_s=timed[-1] - first, start_s=first,
                          end_s=timed[-1], first_step_s=self.ends[0] - self.start,
                          step_times_s=[b - a_ for a_, b in zip([first] + timed[:-1], timed)])
            before, after = self.counters[w - 1], self.counters[-1]
            if before is not None and after is not None:
                result.update(rx_bytes=after[0] - before[0], tx_bytes=after[1] - before[1])
        result.update(extra)
        path = os.path.join(a.out, f"rank{self.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)


def model_and_data(args, rows: int, seed: int = 0):
    """The model of ``--model`` (uncompiled; build it in the strategy's scope) and one
    synthetic batch of ``rows`` rows."""
    from benchmarks import models
    spec = models.mlp(args.width, args.layers) if args.model == "mlp" else models.MODELS[
        args.model]
    return models.build(spec), models.synthetic_batch(spec, rows, seed)


def fit(model, batch, clock: Clock) -> None:
    """Compiles ``model`` (SGD, no XLA) and runs Keras ``fit`` for warm-up + timed steps on
    ``batch`` fed every step, clocking each step."""
    import keras
    import tensorflow as tf
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy",
                  jit_compile=False)

    class StepClock(keras.callbacks.Callback):
        # Overriding a batch hook makes Keras call it synchronously with the step's logs
        # converted to Python numbers, i.e. after the step finished.
        def on_train_batch_begin(self, batch, logs=None):
            clock.before_step(batch)

        def on_train_batch_end(self, batch, logs=None):
            clock.after_step()

    data = tf.data.Dataset.from_tensors(batch).repeat(clock.args.warmup + clock.args.steps)
    clock.begin()
    model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[StepClock()])


def run_single(args, clock: Clock) -> None:
    model, batch = model_and_data(args, args.batch)
    fit(model, batch, clock)
    clock.write()


def run_poseidon(args, clock: Clock) -> None:
    import tf_poseidon as tp  # first: it sizes TensorFlow's thread pools before TF starts
    try:
        strategy = tp.PoseidonStrategy(**json.loads(args.options))
    except NotImplementedError as e:
        clock.write("not available", str(e))
        return
    with strategy.scope():
        model, batch = model_and_data(args, clock.size * args.batch)  # global batches
    fit(model, batch, clock)
    extra = {"params": model.count_params()}
    try:  # the statistics are extra information, never a reason to fail
        report = strategy.stats(last_steps=args.steps)
        records = strategy.extended.engine.stats.records()
        extra.update(poseidon_stats=report["summary"], mode_stats=report.get("mode"),
                     plan=str(strategy.plan()),
                     engine_bytes_sent=sum(r.bytes_sent for r in records),
                     engine_bytes_received=sum(r.bytes_received for r in records))
    except Exception as e:
        extra["poseidon_stats_error"] = repr(e)
    clock.write(**extra)


def run_mwms(args, clock: Clock) -> None:
    rank, size = clock.rank, clock.size
    peers = args.peers.split(",")
    if len(peers) != size:
        raise SystemExit(f"--peers names {len(peers)} workers, the job has {size}")
    if args.peer_hosts and socket.gethostname() != args.peer_hosts.split(",")[rank]:
        raise SystemExit(f"rank {rank} runs on {socket.gethostname()}, but TF_CONFIG places it "
                         f"on {args.peer_hosts.split(',')[rank]}")
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": peers}, "task": {"type": "worker", "index": rank}})
    import keras
    import tensorflow as tf
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    with strategy.scope():
        model, (x, y) = model_and_data(args, args.batch, seed=rank)
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction="none")
    steps = args.warmup + args.steps
    iterator = iter(strategy.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.from_tensors((x, y)).repeat(steps)))

    @tf.function
    def train_step(iterator):
        def step(features, labels):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(labels, model(features, training=True)),
                                                  global_batch_size=size * args.batch)
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss
        return strategy.reduce("SUM", strategy.run(step, args=next(iterator)), axis=None)

    clock.begin()
    for i in range(steps):
        clock.before_step(i)
        train_step(iterator).numpy()
        clock.after_step()
    clock.write()
    # TF's coordination service keeps a finished worker alive until its peers' heartbeats time
    # out (~100 s per run, measured). Once every rank has written its result, every rank is
    # past its last collective, so leaving at once loses nothing.
    paths = [os.path.join(args.out, f"rank{r}.json") for r in range(size)]
    deadline = time.monotonic() + 120.0
    while not all(map(os.path.exists, paths)) and time.monotonic() < deadline:
        time.sleep(0.2)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_allreduce(args, clock: Clock) -> None:
    """Per codec: seconds of each timed all-reduce of ``--megabytes`` (``big_s``) and of 1 KB
    (``small_s``), each after a barrier, following warm-ups (connections, buffers)."""
    import numpy as np
    if args.codecs == ["mpi"]:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        call, sum_into = (lambda fn: fn(comm)), {"mpi": lambda c, x, out: c.Allreduce(x, out)}
    else:
        import tf_poseidon  # noqa: F401  (first: it sizes TensorFlow's thread pools)
        from tf_poseidon.comm import codecs
        from tf_poseidon.comm.engine import get_engine
        call, sum_into = get_engine().call, {c: codecs.get(c).sum_into for c in args.codecs}

    def timed(codec: str, nbytes: int, repeats: int) -> list[float]:
        x = np.ones(nbytes // 4, np.float32)
        out, times = np.empty_like(x), []
        for _ in range(repeats):
            call(lambda comm: comm.Barrier())
            start = time.perf_counter()
            call(lambda comm: sum_into[codec](comm, x, out))
            times.append(time.perf_counter() - start)
        if repeats and not np.allclose(out, clock.size, rtol=1e-2):
            raise AssertionError(f"{codec}: wrong all-reduce result on rank {clock.rank}")
        return times

    big = int(args.megabytes * 2**20)
    results = {}
    for codec in args.codecs:
        timed(codec, big, 1)
        big_s = timed(codec, big, args.repeats)
        timed(codec, 1024, min(20, args.small_repeats))
        results[codec] = {"big_s": big_s, "small_s": timed(codec, 1024, args.small_repeats)}
    clock.write(allreduce=results)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/worker.py")
    p.add_argument("--kind", choices=("single", "poseidon", "mwms", "allreduce"), required=True)
    p.add_argument("--out", required=True, help="directory for the result files")
    p.add_argument("--model", default="tiny", help="a name of benchmarks/models.py, or mlp")
    p.add_argument("--width", type=int, default=1024, help="mlp: inputs and hidden width")
    p.add_argument("--layers", type=int, default=3, help="mlp: hidden layers")
    p.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps (>= 1)")
    p.add_argument("--steps", type=int, default=4, help="timed steps")
    p.add_argument("--options", default="{}", help="PoseidonStrategy keyword arguments, JSON")
    p.add_argument("--nic", help="interface whose counters to read")
    p.add_argument("--peers", default="", help="mwms: host:port of every worker")
    p.add_argument("--peer-hosts", default="", help="mwms: hostname of every worker")
    p.add_argument("--straggler", help="the slowed rank, or 'moving'")
    p.add_argument("--delay", type=float, default=0.1, help="straggler: seconds per slowed step")
    p.add_argument("--every", type=int, default=1, help="straggler: one step in this many")
    p.add_argument("--spin", action="store_true", help="straggler: busy-wait, not sleep")
    p.add_argument("--codecs", nargs="+", default=["mpi"], help="allreduce: mpi or codec names")
    p.add_argument("--megabytes", type=float, default=64.0, help="allreduce: MiB per call")
    p.add_argument("--repeats", type=int, default=5, help="allreduce: timed big calls")
    p.add_argument("--small-repeats", type=int, default=500, help="allreduce: timed 1 KB calls")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1 (the first step builds the graph)")
    if args.codecs != ["mpi"] and "mpi" in args.codecs:
        p.error("--codecs mpi runs alone (its ranks do not import tf_poseidon)")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    clock = Clock(args, *mpi_rank())
    {"single": run_single, "poseidon": run_poseidon, "mwms": run_mwms,
     "allreduce": run_allreduce}[args.kind](args, clock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
