"""One rank of one benchmark configuration (started by benchmarks/suite.py; not run by hand).

::

    python benchmarks/worker.py --kind single --model fc --out DIR --name single
    tfposeidon-run ... python benchmarks/worker.py --kind poseidon --options '{"sfb": "never"}'
    mpirun ... python benchmarks/worker.py --kind mwms --peers 10.77.0.1:23456,10.77.0.2:23456

Kinds:

- ``single``: Keras ``fit`` without any strategy: the compute-only reference. Under ``mpirun``
  it is P independent copies (no communication at all), which shows what sharing the machine's
  cores costs by itself.
- ``poseidon``: ``tp.PoseidonStrategy(**options)`` and Keras ``fit`` on global batches of
  P × batch rows, as users write it. A NotImplementedError from the constructor is recorded as
  "not available" (every rank raises it alike, so the job ends cleanly).
- ``mwms``: TensorFlow's MultiWorkerMirroredStrategy (RING collectives over gRPC) with a custom
  loop (Keras 3 ``fit`` fails under it in TF 2.21, keras#20585); TF_CONFIG is built from
  ``--peers`` and this process's rank under ``mpirun``.

All kinds train on Horovod-style synthetic data (one random batch with fixed random labels,
fed every step) with SGD, no metrics. Timing: the wall time from the end of the last warm-up
step to the end of the last step, measured at the end of each step once its loss is on the host
(a Keras callback for ``fit``; ``.numpy()`` in the custom loop). Bytes on the wire: this host's
``--nic`` transmit/receive counters (``/proc/net/dev`` of the process's network namespace, i.e.
the emulated host's ``eth0``) read at the same two moments.

Every rank writes ``OUT/NAME.rank<r>.json``; rank 0 appends progress lines to
``OUT/NAME.progress`` (the suite shows them while it waits).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

if __package__ in (None, ""):
    # Run as a file (python benchmarks/X.py): make the ``benchmarks`` package importable by
    # appending the repository root, after everything else, so that an installed tf_poseidon
    # is not shadowed by the checkout; and drop this directory (its module names are generic).
    _HERE = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
        del sys.path[0]
    sys.path.append(os.path.dirname(_HERE))

_T0 = time.perf_counter()


def launcher_rank() -> tuple[int, int]:
    """(rank, size) from Open MPI's/PMI's environment, (0, 1) without a launcher."""
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMIX_RANK", "PMIX_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def nic_counters(nic: str | None) -> tuple[int, int] | None:
    """(rx_bytes, tx_bytes) of ``nic`` in this process's network namespace, or None."""
    if not nic:
        return None
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == nic:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    return None


class Recorder:
    """Step-end timestamps and NIC counters of one rank; writes its result file."""

    def __init__(self, args, rank: int, size: int):
        self.args, self.rank, self.size = args, rank, size
        self.ends: list[float] = []
        self.counters: list[tuple[int, int] | None] = []
        self.extra: dict = {}
        self.progress_path = os.path.join(args.out, f"{args.name}.progress")

    def progress(self, text: str) -> None:
        if self.rank == 0:
            with open(self.progress_path, "a") as f:
                f.write(f"{text}\n")

    def step_end(self) -> None:
        """Called once per training step, after the step's loss reached the host."""
        self.ends.append(time.perf_counter())
        self.counters.append(nic_counters(self.args.nic))
        done, total = len(self.ends), self.args.warmup + self.args.steps
        last = self.ends[-1] - (self.ends[-2] if done > 1 else self.start)
        phase = "warm-up" if done <= self.args.warmup else "timed"
        self.progress(f"step {done}/{total} ({phase}) {last:.2f} s")

    def begin(self) -> None:
        self.start = time.perf_counter()
        self.progress(f"set up in {self.start - _T0:.1f} s; training")

    def write(self, status: str = "ok", message: str = "") -> None:
        a = self.args
        result = {"name": a.name, "kind": a.kind, "model": a.model, "rank": self.rank,
                  "size": self.size, "host": socket.gethostname(), "status": status,
                  "message": message, "batch": a.batch, "warmup": a.warmup,
                  "affinity_cpus": len(os.sched_getaffinity(0)),
                  "intra_op_threads_env": os.environ.get("TF_NUM_INTRAOP_THREADS"),
                  "loadavg": os.getloadavg()[0], **self.extra}
        if status == "ok":
            w = a.warmup  # >= 1: the first step traces and builds; it is never timed
            if len(self.ends) < w + 1:
                raise RuntimeError(f"only {len(self.ends)} steps ran; {w} warm-up + 1 needed")
            first, timed = self.ends[w - 1], self.ends[w:]
            result["steps"] = len(timed)
            result["window_s"] = timed[-1] - first
            result["step_times_s"] = [b - a_ for a_, b in zip([first] + timed[:-1], timed)]
            result["first_step_s"] = self.ends[0] - self.start
            before = self.counters[w - 1]
            after = self.counters[-1]
            if before is not None and after is not None:
                result["rx_bytes"] = after[0] - before[0]
                result["tx_bytes"] = after[1] - before[1]
        path = os.path.join(a.out, f"{a.name}.rank{self.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)


def run_fit(model, dataset, recorder: Recorder) -> None:
    """Keras ``fit`` over ``dataset`` for warmup + steps steps, timing each step."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        # Overriding a batch hook makes Keras call it synchronously with the step's logs
        # converted to Python numbers, i.e. after the step finished.
        def on_train_batch_end(self, batch, logs=None):
            recorder.step_end()

    recorder.begin()
    model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=[StepTimer()])


def compile_model(model) -> None:
    import keras
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy",
                  jit_compile=False)


def main_single(args, recorder: Recorder) -> None:
    import tensorflow as tf
    from benchmarks import models
    model = models.build(args.model)
    compile_model(model)
    x, y = models.synthetic_batch(args.model, args.batch)
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat(args.warmup + args.steps)
    run_fit(model, dataset, recorder)
    recorder.write()


def main_poseidon(args, recorder: Recorder) -> None:
    import tf_poseidon as tp  # first: it sizes TensorFlow's thread pools before TF starts
    options = json.loads(args.options)
    try:
        strategy = tp.PoseidonStrategy(**options)
    except NotImplementedError as e:
        recorder.write("not available", str(e))
        return
    import tensorflow as tf
    from benchmarks import models
    with strategy.scope():
        model = models.build(args.model)
        compile_model(model)
    size = strategy.num_replicas_in_sync
    x, y = models.synthetic_batch(args.model, size * args.batch)  # global batches
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat(args.warmup + args.steps)
    run_fit(model, dataset, recorder)
    stats = getattr(strategy, "stats", None)
    if stats is not None:
        try:
            recorder.extra["poseidon_stats"] = stats(last_steps=args.steps).get("summary")
        except Exception as e:  # the stats are extra information, never a reason to fail
            recorder.extra["poseidon_stats_error"] = repr(e)
    recorder.write()


def main_mwms(args, recorder: Recorder) -> None:
    rank, size = recorder.rank, recorder.size
    peers = args.peers.split(",")
    if len(peers) != size:
        raise SystemExit(f"--peers names {len(peers)} workers, the job has {size}")
    if args.peer_hosts:
        expected = args.peer_hosts.split(",")[rank]
        if socket.gethostname() != expected:
            raise SystemExit(f"rank {rank} runs on {socket.gethostname()}, but TF_CONFIG "
                             f"places it on {expected}")
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": peers}, "task": {"type": "worker", "index": rank}})
    import keras
    import tensorflow as tf
    from benchmarks import models
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    global_batch = size * args.batch
    with strategy.scope():
        model = models.build(args.model)
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction="none")
    x, y = models.synthetic_batch(args.model, args.batch, seed=rank)

    def dataset_fn(context):
        return tf.data.Dataset.from_tensors((x, y)).repeat(args.warmup + args.steps)

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

    @tf.function
    def train_step(iterator):
        def step(features, labels):
            with tf.GradientTape() as tape:
                predictions = model(features, training=True)
                loss = tf.nn.compute_average_loss(loss_fn(labels, predictions),
                                                  global_batch_size=global_batch)
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss
        return strategy.reduce("SUM", strategy.run(step, args=next(iterator)), axis=None)

    recorder.begin()
    for _ in range(args.warmup + args.steps):
        train_step(iterator).numpy()
        recorder.step_end()
    recorder.write()
    # TF's coordination service keeps a finished worker alive until its peers' heartbeats
    # time out (~100 s per run, measured). Once every rank has written its result, every
    # rank is past its last collective, so leaving at once loses nothing.
    wait_for_results(args, size)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def wait_for_results(args, size: int, timeout_s: float = 120.0) -> None:
    """Blocks until every rank's result file exists (or ``timeout_s`` passes)."""
    paths = [os.path.join(args.out, f"{args.name}.rank{r}.json") for r in range(size)]
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/worker.py")
    parser.add_argument("--kind", choices=("single", "poseidon", "mwms"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--name", required=True, help="configuration name (file names)")
    parser.add_argument("--out", required=True, help="directory for the result files")
    parser.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--options", default="{}", help="PoseidonStrategy keyword arguments")
    parser.add_argument("--nic", default=None, help="interface whose counters to read")
    parser.add_argument("--peers", default="", help="MWMS: host:port of every worker")
    parser.add_argument("--peer-hosts", default="", help="MWMS: hostname of every worker")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1 (the first step builds the graph)")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.kind == "poseidon":
        import tf_poseidon as tp
        rank, size = tp.rank(), tp.size()
    else:
        rank, size = launcher_rank()
    recorder = Recorder(args, rank, size)
    {"single": main_single, "poseidon": main_poseidon, "mwms": main_mwms}[args.kind](
        args, recorder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
