"""One rank of a benchmark job, started by benchmarks/runner.py (``python benchmarks/worker.py
--kind KIND --out DIR ...``, a process per rank). Kinds:

- ``single``: Keras fit without a strategy; under ``mpirun``, P independent copies.
- ``poseidon``: Keras fit under ``tp.PoseidonStrategy(**options)`` on global batches of P ×
  batch rows; a NotImplementedError from the constructor is recorded as "not available".
- ``mwms``: TensorFlow's MultiWorkerMirroredStrategy (RING over gRPC) in a custom loop (Keras 3
  fit fails under it in TF 2.21, keras#20585); TF_CONFIG from ``--peers`` and the MPI rank.
- ``allreduce``: all-reduces of ``--megabytes`` (in ``--pieces``) and of 1 KB of float32 per
  codec of ``--codecs`` (``mpi``: mpi4py's, in a process that never imports tf_poseidon).
- ``agreement``: ``--repeats`` collective agreement checks (tf_poseidon/comm/agreement.py).

The training kinds fit ``--model`` (benchmarks/models.py) on synthetic data with SGD, timed by
one step clock (:class:`Clock`), then profile ``--profile`` more steps (tf_poseidon.profiling:
seconds per phase of a step). Every result holds the rank's peak resident memory. Every rank
writes ``DIR/rank<r>.json`` (atomically); rank 0 appends progress lines to ``DIR/progress``.
"""

import argparse
import json
import os
import resource
import socket
import sys
import time

if __package__ in (None, ""):
    # Started as a file: make ``benchmarks`` importable by appending the repository root after
    # everything else (an installed tf_poseidon stays first) and drop this directory.
    _HERE = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
        del sys.path[0]
    sys.path.append(os.path.dirname(_HERE))

_T0 = time.perf_counter()


def tx_bytes(nic: str) -> int | None:
    """Bytes sent so far through ``nic`` (in this process's network namespace); None: no nic."""
    with open("/proc/self/net/dev") as f:
        fields = {n.strip(): rest.split() for n, _, rest in (line.partition(":") for line in f)}
    return int(fields[nic][8]) if nic in fields else None


class Clock:
    """One rank's step clock, called on the training thread. A step ends when its loss is on
    the host; the timed window runs from the end of the last warm-up step to the end of the
    last step, and ``--nic``'s transmit counter is read at the same moments. Before steps
    N-1, 2N-1, ... (``--every N``) the straggler rank (``--straggler R``, or ``moving``: rank
    0, then 1, ...) sleeps ``--delay`` seconds."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.ends, self.sent, self.start = args, [], [], time.perf_counter()
        self.rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0))  # mpirun's and
        self.size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))  # tfposeidon-run's

    def progress(self, text: str) -> None:
        if self.rank == 0:
            with open(os.path.join(self.args.out, "progress"), "a") as f:
                f.write(text + "\n")

    def begin(self) -> None:
        self.start = time.perf_counter()
        self.progress(f"set up in {self.start - _T0:.1f} s; training")

    def before_step(self, step: int) -> None:
        a = self.args
        if a.straggler is not None and step % a.every == a.every - 1 and self.rank == (
                (step // a.every) % self.size if a.straggler == "moving" else int(a.straggler)):
            time.sleep(a.delay)

    def after_step(self) -> None:
        if len(self.ends) == self.args.warmup + self.args.steps:
            return  # a profiled step (--profile), after the timed ones
        self.ends.append(time.perf_counter())
        self.sent.append(tx_bytes(self.args.nic) if self.args.nic else None)
        done, w = len(self.ends), self.args.warmup
        self.progress(f"step {done}/{w + self.args.steps} ({'warm-up' if done <= w else 'timed'})"
                      f" {self.ends[-1] - (self.ends[-2] if done > 1 else self.start):.2f} s")

    def write(self, status: str = "ok", message: str = "", **extra) -> None:
        """Writes this rank's result: the timed figures (if steps ran) and ``extra``."""
        a, w = self.args, self.args.warmup  # >= 1: the first step traces; it is never timed
        result = {"kind": a.kind, "rank": self.rank, "size": self.size, "status": status,
                  "message": message, "host": socket.gethostname(), "batch": a.batch,
                  "warmup": w, "loadavg": os.getloadavg()[0],
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if status == "ok" and self.ends:
            first, timed = self.ends[w - 1], self.ends[w:]
            result.update(steps=len(timed), window_s=timed[-1] - first, start_s=first,
                          end_s=timed[-1],
                          step_times_s=[b - a_ for a_, b in zip([first] + timed[:-1], timed)])
            if self.sent[-1] is not None:
                result["tx_bytes"] = self.sent[-1] - self.sent[w - 1]
        path = os.path.join(a.out, f"rank{self.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(result | extra, f)
        os.replace(path + ".tmp", path)


def model_and_data(args, rows: int, seed: int = 0, compiled: bool = True):
    """``--model`` (built in the caller's strategy scope; compiled for fit: SGD, no XLA, with
    ``--dense-gradients`` sparse gradients applied as dense tensors, as Horovod's
    ``sparse_as_dense``) and ``rows`` rows of synthetic data."""
    import keras
    import tensorflow as tf
    from benchmarks import models

    class DenseGradientsSGD(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            return super().apply([tf.convert_to_tensor(g) for g in grads], trainable_variables)

    spec = models.mlp(args.width, args.layers) if args.model == "mlp" else models.MODELS[
        args.model]
    model = models.build(spec)
    if compiled:
        model.compile(optimizer=(DenseGradientsSGD if args.dense_gradients else
                                 keras.optimizers.SGD)(0.01), jit_compile=False,
                      loss="sparse_categorical_crossentropy")
    return model, models.synthetic_batch(spec, rows, seed)


def fit(model, batch, clock: Clock) -> dict:
    """Keras fit of ``model`` on ``batch`` fed every step, clocked; then ``--profile`` more
    steps profiled (tf_poseidon.profiling). Returns ``{"profile": phases}`` or {}."""
    import keras
    import tensorflow as tf

    a, profiler = clock.args, None
    if a.profile:
        from tf_poseidon.profiling import StepProfiler
        profiler = StepProfiler(a.warmup + a.steps, a.profile, verbose=False)

    class StepClock(keras.callbacks.Callback):
        # Overriding a batch hook makes Keras call it synchronously with the step's logs
        # converted to Python numbers, i.e. after the step finished.
        def on_train_batch_begin(self, batch, logs=None):
            clock.before_step(batch)

        def on_train_batch_end(self, batch, logs=None):
            clock.after_step()

    clock.begin()
    model.fit(tf.data.Dataset.from_tensors(batch).repeat(a.warmup + a.steps + a.profile),
              epochs=1, verbose=0, callbacks=[StepClock()] + [profiler] * bool(profiler))
    return {"profile": profiler.profile.as_dict()} if profiler and profiler.profile else {}


def run_fit(args, clock: Clock) -> None:
    """The ``single`` and ``poseidon`` kinds."""
    if args.kind == "single":
        return clock.write(**fit(*model_and_data(args, args.batch), clock))
    import tf_poseidon as tp  # first: it sizes TensorFlow's thread pools before TF starts
    if args.no_agreement:  # the ranks' collective agreement checks become no-ops
        from tf_poseidon.comm import agreement
        agreement.agree = lambda *_: None
    try:
        strategy = tp.PoseidonStrategy(**json.loads(args.options))
    except NotImplementedError as e:  # every rank raises it alike: the job ends cleanly
        return clock.write("not available", str(e))
    with strategy.scope():
        model, batch = model_and_data(args, clock.size * args.batch)  # global batches
    profile = fit(model, batch, clock)
    try:  # the statistics are extra information, never a reason to fail
        report = strategy.stats(args.steps)
        extra = {"poseidon_stats": report["summary"], "mode_stats": report.get("mode"),
                 "plan": str(strategy.plan()), "engine_bytes_sent": sum(
                     r.bytes_sent for r in strategy.extended.engine.stats.records())}
    except Exception as e:
        extra = {"poseidon_stats_error": repr(e)}
    clock.write(**extra, **profile)


def run_mwms(args, clock: Clock) -> None:
    rank, size, peers = clock.rank, clock.size, args.peers.split(",")
    if len(peers) != size:
        raise SystemExit(f"--peers names {len(peers)} workers, the job has {size}")
    if args.peer_hosts and socket.gethostname() != args.peer_hosts.split(",")[rank]:
        raise SystemExit(f"rank {rank} runs on {socket.gethostname()}, but TF_CONFIG places it "
                         f"on {args.peer_hosts.split(',')[rank]}")
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": peers}, "task": {"type": "worker", "index": rank}})
    import keras
    import tensorflow as tf
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING))
    with strategy.scope():
        model, (x, y) = model_and_data(args, args.batch, seed=rank, compiled=False)
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
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(args.out, f"rank{r}.json")) for r in range(size)):
        time.sleep(0.2)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_allreduce(args, clock: Clock) -> None:
    """Per codec: seconds of each timed all-reduce of ``--megabytes`` (``big_s``: as
    ``--pieces`` all-reduces back to back, as a step's buckets go) and of 1 KB (``small_s``),
    each after a barrier, following warm-ups (connections, buffers)."""
    import numpy as np
    if args.codecs == ["mpi"]:
        from mpi4py import MPI
        call = lambda fn: fn(MPI.COMM_WORLD)  # noqa: E731
        sum_into = {"mpi": lambda comm, x, out: comm.Allreduce(x, out)}
    else:
        import tf_poseidon  # noqa: F401  (first: it sizes TensorFlow's thread pools)
        from tf_poseidon.comm import codecs, engine
        call = engine.get_engine().call
        sum_into = {c: codecs.get(c).sum_into for c in args.codecs}

    def timed(codec: str, nbytes: int, repeats: int, pieces: int = 1) -> list[float]:
        x, times = np.ones(nbytes // 4, np.float32), []
        out = np.empty_like(x)
        parts = list(zip(np.array_split(x, pieces), np.array_split(out, pieces)))
        for _ in range(repeats):
            call(lambda comm: comm.Barrier())
            start = time.perf_counter()
            call(lambda comm: [sum_into[codec](comm, a, b) for a, b in parts])
            times.append(time.perf_counter() - start)
        if repeats and not np.allclose(out, clock.size, rtol=1e-2):
            raise AssertionError(f"{codec}: wrong all-reduce result on rank {clock.rank}")
        return times

    results, big = {}, int(args.megabytes * 2**20)
    for codec in args.codecs:
        timed(codec, big, 1, args.pieces)
        big_s = timed(codec, big, args.repeats, args.pieces)
        timed(codec, 1024, min(20, args.small_repeats))
        results[codec] = {"big_s": big_s, "small_s": timed(codec, 1024, args.small_repeats)}
    clock.write(allreduce=results)


def run_agreement(args, clock: Clock) -> None:
    """``check_s``: seconds per agreement of a 4-bucket gradient signature, the mean of
    ``--repeats`` after 50 warm-ups, timed from a barrier."""
    from tf_poseidon import world
    from tf_poseidon.comm import agreement
    comm = world.mpi_comm()
    signature = agreement.Signature("gradients", 0, (("allreduce", 4 << 20, "float32"),) * 4)
    for _ in range(50):
        agreement.agree(comm, signature, 60)
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(args.repeats):
        agreement.agree(comm, signature, 60)
    clock.write(check_s=(time.perf_counter() - start) / args.repeats)


KINDS = {"single": run_fit, "poseidon": run_fit, "mwms": run_mwms, "allreduce": run_allreduce,
         "agreement": run_agreement}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/worker.py", description=__doc__)
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument("--out", required=True, help="directory for the result files")
    p.add_argument("--options", default="{}", help="PoseidonStrategy keyword arguments, JSON")
    p.add_argument("--model", default="tiny", help="a name in benchmarks/models.py, or mlp")
    p.add_argument("--straggler", help="the slowed rank, or moving")
    p.add_argument("--codecs", nargs="+", default=["mpi"])
    for flag in ("dense-gradients", "no-agreement"):
        p.add_argument(f"--{flag}", action="store_true")
    for flag, default in (("width", 1024), ("layers", 3), ("batch", 32), ("warmup", 1),
                          ("steps", 4), ("profile", 0), ("every", 1), ("repeats", 5),
                          ("small-repeats", 500), ("pieces", 1),
                          ("delay", 0.1), ("megabytes", 64.0), ("nic", ""),
                          ("peers", ""), ("peer-hosts", "")):  # mwms: every worker's address
        p.add_argument(f"--{flag}", type=type(default), default=default)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1 (the first step builds the graph)")
    if args.codecs != ["mpi"] and "mpi" in args.codecs:
        p.error("--codecs mpi runs alone (its ranks do not import tf_poseidon)")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    KINDS[args.kind](args, Clock(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
