"""Collective agreement in one process (comm/agreement.py, comm/engine.py): real CommEngine
objects, one per rank, on the loopback communicator. Ranks that post different collectives all
raise CollectiveMismatchError naming each side, each prints it first, the hint fits what was
posted, and a peer that posts nothing ends the wait after the timeout; at the end of the
program a rank waits for peers that send heartbeats and gives up on silent or stuck ones.
Asynchronous EASGD's drain notices decide when an exchange means the ranks diverged. The same
at P=2 in real jobs: tests/test_collective_agreement.py."""

import time

import numpy as np
import pytest

from tf_poseidon import algorithms
from tf_poseidon.algorithms import easgd, easgd_center, ssp, sync
from tf_poseidon.comm import agreement
from tf_poseidon.comm.buckets import Bucket, Item
from tf_poseidon.comm.codecs import Exact
from tf_poseidon.comm.engine import ENGINE_REPORT_GRACE_S, CollectiveGroup, CommEngine
from tf_poseidon.comm.errors import CollectiveMismatchError, CollectiveTimeoutError
from tf_poseidon.comm.protocol import AllReduce
from tf_poseidon.testing.loopback import LoopbackWorld

WORLD_TIMEOUT_S = 30  # the loopback's own bound on any wait; above every limit used here


def group(name, sizes=(2,)):
    """A group of all-reduce buckets of float32 items of ``sizes`` elements."""
    items = [Item(f"{name}/{i}", (n,), np.dtype(np.float32), n) for i, n in enumerate(sizes)]
    buckets = [Bucket(i, "allreduce", (i,), (item,), item.payload_dtype)
               for i, item in enumerate(items)]
    return CollectiveGroup(name, buckets, {"allreduce": AllReduce(Exact())})


def post(engine, what):
    """Posts ``what`` on ``engine`` and returns what it raised (or its result): ("group",
    name, sizes) submits every bucket and waits for bucket 0; ("call", label) is an engine
    call; ("end",) the end of the program."""
    try:
        if what[0] == "group":
            posted = group(*what[1:])
            for bucket in posted.buckets:
                engine.submit(posted, bucket.index,
                              np.ones(bucket.items[0].num_elements, np.float32))
            return posted.wait_result(0)
        if what[0] == "call":
            return engine.call(lambda comm: "ran", label=what[1])
        return engine.end_of_program()
    except (CollectiveMismatchError, CollectiveTimeoutError) as e:
        return e


SCENARIOS = {
    # what each rank posts, then the message every rank must raise
    "a metric beside a step": (
        [("group", "metrics"), ("group", "gradients", (3, 5))],
        "rank 0 posted metrics instance 0 (1 bucket: allreduce 8 B float32); rank 1 posted "
        "gradients step 0 (2 buckets: allreduce 12 B float32, allreduce 20 B float32). Every "
        "rank must run the same collectives in the same order. One rank was still training "
        "while another had moved on"),
    "a call beside a reduction": (
        [("call", "input data"), ("group", "reduce")],
        "rank 0 posted control-plane call 'input data'; rank 1 posted reduce instance 0 (1 "
        "bucket: allreduce 8 B float32). Every rank must run the same collectives in the same "
        "order. Look for a collective (evaluate, predict, strategy.reduce/gather, a callback "
        "that reduces) that runs on some ranks only."),
    "a rank at the end": (
        [("group", "gradients"), ("end",)],
        "rank 0 posted gradients step 0 (1 bucket: allreduce 8 B float32); rank 1 posted "
        "control-plane call 'end of program'. Every rank must run the same collectives in the "
        "same order. A rank reached the end of its program while another still communicated"),
    "two against one": (
        [("group", "gradients"), ("group", "metrics"), ("group", "gradients")],
        "ranks 0, 2 posted gradients step 0 (1 bucket: allreduce 8 B float32); rank 1 posted "
        "metrics instance 0 (1 bucket: allreduce 8 B float32)."),
    "the end of an epoch beside the end of fit": (
        [("call", agreement.EPOCH_END_MEETING), ("call", easgd.DRAIN_MEETING)],
        "rank 0 posted control-plane call 'the meeting of all ranks at the end of an epoch'; "
        "rank 1 posted control-plane call 'the asynchronous EASGD meeting of a drain (the end "
        "of fit)'. "
        "Every rank must run the same collectives in the same order. One rank was still "
        "training"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_rank_raises_naming_each_side(scenario, capsys):
    posts, expected = SCENARIOS[scenario]

    def rank_main(comm):
        engine = CommEngine(comm)
        engine.declare_training_groups(sync.Sync.training_groups)
        start = time.monotonic()
        error = post(engine, posts[comm.rank])
        seconds = time.monotonic() - start
        # Once diverged, the engine fails every later collective with the same error.
        return error, seconds, post(engine, ("group", "metrics"))

    outcomes = LoopbackWorld(len(posts), WORLD_TIMEOUT_S).run(rank_main)
    printed = capsys.readouterr().err
    for rank, (error, seconds, later) in enumerate(outcomes):
        assert isinstance(error, CollectiveMismatchError), (rank, error)
        assert str(error).startswith(f"tf_poseidon: the ranks posted different collectives: "
                                     f"{expected}"), (rank, str(error))
        assert seconds < 5, (rank, seconds)
        assert later is error
        # Printed by each rank before any raised: in a job, before one aborts the others.
        assert (f"[tf_poseidon rank {rank}] CollectiveMismatchError: the ranks posted "
                f"different collectives: {expected}") in printed, printed


def test_the_hint_follows_what_the_sides_posted():
    def message(*sides, training=()):
        return agreement.mismatch_message([(what, what) for what in sides], training)
    end = "A rank reached the end of its program"
    training = "One rank was still training while another had moved on"
    elsewhere = "Look for a collective"
    assert end in message(agreement.END_OF_PROGRAM, "gradients", training=["gradients"])
    assert training in message("metrics", "ssp_deltas", training=["ssp_deltas"])
    assert elsewhere in message("metrics", "ssp_deltas")  # not declared by the algorithm
    assert training in message("reduce", agreement.EPOCH_END_MEETING)  # any algorithm's
    assert training in message("reduce", "micro_batch")
    # A rank that writes for all ranks alone: the save, whatever the other rank posted.
    saving = "Some ranks were saving and others were not"
    for other in (agreement.END_OF_PROGRAM, "gradients", "reduce"):
        hint = message(agreement.RANK0_WRITE, other, training=["gradients"])
        assert saving in hint and end not in hint and training not in hint, hint
    # Each algorithm declares the groups its training steps post.
    assert sync.Sync.training_groups == (sync.GRADIENTS,)
    assert algorithms.SSP.training_groups == (sync.GRADIENTS, ssp.DELTAS)
    assert algorithms.EASGD.training_groups == (easgd.MOVE, easgd.RESEED, easgd.EXCHANGE)


def test_a_peer_that_posts_nothing_times_out_naming_what_was_posted(monkeypatch):
    monkeypatch.setenv("TF_POSEIDON_TIMEOUT", "1")

    def rank_main(comm):
        if comm.rank == 1:
            return None  # posts nothing
        start = time.monotonic()
        error = post(CommEngine(comm), ("group", "metrics"))
        return error, time.monotonic() - start

    error, seconds = LoopbackWorld(2, WORLD_TIMEOUT_S).run(rank_main)[0]
    assert isinstance(error, CollectiveTimeoutError)
    assert str(error) == (
        "tf_poseidon: this rank posted metrics instance 0 (1 bucket: allreduce 8 B float32) and "
        "waited 1 s for the other ranks to post theirs: a peer rank has died, hangs, or runs a "
        "different program. Set TF_POSEIDON_TIMEOUT to wait longer.")
    assert 1 <= seconds < 1 + ENGINE_REPORT_GRACE_S  # the engine's message, not the waiter's


# -- the end of the program (CommEngine.end_of_program) ----------------------------------------

def run_end(behaviour_of_rank_0, monkeypatch, silence_s="1", limit_s="3600"):
    """Rank 1 reaches the end of its program at once; rank 0 runs ``behaviour_of_rank_0(comm)``
    first. Returns (what rank 1's end_of_program returned or raised, its seconds, the
    ``time.monotonic()`` at which it returned)."""
    monkeypatch.setenv("TF_POSEIDON_TIMEOUT", silence_s)
    monkeypatch.setenv("TF_POSEIDON_MEETING_TIMEOUT", limit_s)

    def rank_main(comm):
        if comm.rank == 0:
            return behaviour_of_rank_0(comm)
        engine = CommEngine(comm)
        start = time.monotonic()
        outcome = post(engine, ("end",))
        finished = time.monotonic()
        return outcome, finished - start, finished

    return LoopbackWorld(2, WORLD_TIMEOUT_S).run(rank_main)[1]


def test_the_end_waits_for_a_peer_that_works_longer_than_the_step_timeout(monkeypatch):
    reached_end = []

    def works_then_ends(comm):  # its engine thread answers while the rank works
        engine = CommEngine(comm)
        time.sleep(4)
        reached_end.append(time.monotonic())
        return engine.end_of_program()

    # A step timeout of 3 s: three heartbeats' intervals, for a busy machine's threads. Rank 1
    # starts its clock when its own engine is up, a moment after rank 0's sleep may have begun,
    # so what shows that it waited for rank 0 is that it returned after rank 0 reached its end.
    outcome, seconds, finished = run_end(works_then_ends, monkeypatch, silence_s="3")
    assert outcome is None and finished >= reached_end[0] and 3.5 < seconds < 6, (
        outcome, seconds, finished - reached_end[0])


def test_the_end_gives_up_on_a_silent_peer_after_the_step_timeout(monkeypatch):
    # No thread of rank 0 runs, as in a stopped process.
    error, seconds, _ = run_end(lambda comm: time.sleep(6), monkeypatch)
    assert isinstance(error, CollectiveTimeoutError)
    assert str(error) == (
        "tf_poseidon: this rank has reached the end of its program and waits for rank 0, which "
        "sent no heartbeat for 1 s (TF_POSEIDON_TIMEOUT): a stopped process, or one whose "
        "Python threads cannot run.")
    assert 1 <= seconds < 3, seconds


def test_the_end_gives_up_on_a_peer_stuck_longer_than_the_meeting_limit(monkeypatch):
    def stuck(comm):  # alive (its engine answers), but never at the end
        CommEngine(comm)
        time.sleep(8)

    error, seconds, _ = run_end(stuck, monkeypatch, limit_s="3")
    assert isinstance(error, CollectiveTimeoutError)
    assert str(error) == (
        "tf_poseidon: this rank has reached the end of its program and has waited 3 s "
        "(TF_POSEIDON_MEETING_TIMEOUT) for rank 0, alive but not at the end of the program: "
        "stuck (a deadlock, an endless loop), or working alone for longer than that.")
    assert 3 <= seconds < 5, seconds


# -- asynchronous EASGD's drain notices (algorithms/easgd_center.py) ----------------------------

def test_an_exchange_past_the_step_of_another_ranks_drain_is_a_divergence():
    # Rank 0 drains after 10 steps. Rank 1 below that step is catching up (a slower rank of a
    # custom loop); past it, it trains where rank 0 stopped. Once rank 1 has drained too, the
    # notice is an old one.
    def rank_main(comm):
        notices = easgd_center.DrainNotices(comm)
        if comm.rank == 0:
            notices.announce(10)
            comm.Barrier()
            return None
        comm.Barrier()  # rank 0's notice has been sent
        before = [notices.passed(step) for step in (5, 10, 11)]
        notices.announce(10)
        return before, notices.passed(11)

    before, after = LoopbackWorld(2, WORLD_TIMEOUT_S).run(rank_main)[1]
    assert before == [[], [], [0]]
    assert after == []
