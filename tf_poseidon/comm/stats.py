"""What the engine measured: per-bucket records, and the per-step report ``strategy.stats()``.

Times are ``time.perf_counter()`` seconds of this process. A *step* is one instance of the
"gradients" group: the buckets of one training step's gradient reduction.

* communication time of a bucket: from the moment the engine posts it to its completion;
* overlapped time: the part of that which falls before the step's last bucket was handed over
  — the backward pass was still producing gradients then, so that communication ran alongside
  computation;
* step time: from one step's first hand-over to the next step's (so it includes the forward
  pass); the last step of the log has none.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import threading
from typing import Any


@dataclasses.dataclass(frozen=True)
class BucketRecord:
    """One bucket the engine ran."""

    group: str
    group_id: int
    instance: int
    index: int
    layers: tuple[tuple[str, int], ...]  # (name, payload bytes) of each tensor in the bucket
    payload_bytes: int
    bytes_sent: float
    bytes_received: float
    queued_at: float
    start: float
    end: float


class CommStats:
    """A bounded log of the last buckets the engine ran. Thread-safe."""

    def __init__(self, max_records: int = 65536):
        self._records: collections.deque[BucketRecord] = collections.deque(maxlen=max_records)
        self._lock = threading.Lock()

    def record(self, record: BucketRecord) -> None:
        with self._lock:
            self._records.append(record)

    def records(self) -> list[BucketRecord]:
        with self._lock:
            return list(self._records)


def _overlap(record: BucketRecord, backward_end: float) -> float:
    return max(0.0, min(record.end, backward_end) - record.start)


def step_report(records: list[BucketRecord], last_steps: int = 20,
                group: str = "gradients") -> dict[str, Any]:
    """The report ``strategy.stats()`` returns, from the engine's records.

    Keys: ``steps`` (one dict per step, oldest first: ``step_time_s`` (None for the last),
    ``comm_time_s``, ``overlapped_s``, ``bytes_sent``, ``bytes_received``, ``buckets``: per
    bucket ``index``, ``bytes_sent``, ``bytes_received``, ``comm_time_s``, ``wait_s`` (handed
    over → posted), ``layers``), ``per_layer`` (variable name → bytes sent and received per
    step), ``summary`` (means over the steps: ``step_time_s``, ``comm_time_s``,
    ``overlapped_s``, ``hidden_fraction`` = overlapped / communication, bytes per step).
    """
    # A step is one instance of one traced group (a retrace makes a new group).
    by_step: dict[tuple[int, int], list[BucketRecord]] = collections.defaultdict(list)
    for r in records:
        if r.group == group:
            by_step[(r.group_id, r.instance)].append(r)
    instances = sorted(by_step, key=lambda key: min(r.queued_at for r in by_step[key]))
    instances = instances[-last_steps:]
    steps = []
    for position, instance in enumerate(instances):
        buckets = sorted(by_step[instance], key=lambda r: r.index)
        first_handover = min(r.queued_at for r in buckets)
        backward_end = max(r.queued_at for r in buckets)
        following = instances[position + 1] if position + 1 < len(instances) else None
        step_time = (min(r.queued_at for r in by_step[following]) - first_handover
                     if following is not None else None)
        steps.append({
            "step_time_s": step_time,
            "comm_time_s": sum(r.end - r.start for r in buckets),
            "overlapped_s": sum(_overlap(r, backward_end) for r in buckets),
            "bytes_sent": sum(r.bytes_sent for r in buckets),
            "bytes_received": sum(r.bytes_received for r in buckets),
            "buckets": [{"index": r.index, "bytes_sent": r.bytes_sent,
                         "bytes_received": r.bytes_received, "comm_time_s": r.end - r.start,
                         "wait_s": r.start - r.queued_at,
                         "layers": [name for name, _ in r.layers]}
                        for r in buckets],
        })
    per_layer: dict[str, dict[str, float]] = {}
    if instances:
        for r in by_step[instances[-1]]:
            for name, nbytes in r.layers:
                share = nbytes / r.payload_bytes if r.payload_bytes else 0.0
                per_layer[name] = {"bytes_sent": r.bytes_sent * share,
                                   "bytes_received": r.bytes_received * share}

    def mean(key):
        values = [s[key] for s in steps if s[key] is not None]
        return statistics.fmean(values) if values else None

    comm, overlapped = mean("comm_time_s"), mean("overlapped_s")
    return {
        "steps": steps,
        "per_layer": per_layer,
        "summary": {
            "steps": len(steps),
            "step_time_s": mean("step_time_s"),
            "comm_time_s": comm,
            "overlapped_s": overlapped,
            "hidden_fraction": (overlapped / comm) if comm else None,
            "bytes_sent": mean("bytes_sent"),
            "bytes_received": mean("bytes_received"),
        },
    }
