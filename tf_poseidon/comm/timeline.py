"""A Chrome-trace timeline of the engine's buckets, for Perfetto or chrome://tracing.

Every rank records, per bucket, two complete ("X") events on the engine's track: ``wait``
(handed over by the graph → posted by the engine) and the collective itself, with the bucket's
bytes and layers in ``args``. Process id = rank, so each rank is a row group. Timestamps are
wall-clock microseconds, so ranks on one host line up (across hosts, as well as their clocks do).

The events are kept in memory (bounded) and, when the process exits normally, gathered to rank
0, which writes one JSON file atomically (temp file + rename). A job that aborts writes none.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import tempfile
import time

MAX_EVENTS = 200_000


class Timeline:
    """Collects one rank's events; written by rank 0 for all ranks at exit."""

    def __init__(self, rank: int, path: str):
        self.rank = rank
        self.path = os.path.abspath(path)
        self._events: collections.deque[dict] = collections.deque(maxlen=MAX_EVENTS)
        # perf_counter → wall clock, fixed once so durations stay exact.
        self._offset_s = time.time() - time.perf_counter()

    def _us(self, t: float) -> float:
        return (t + self._offset_s) * 1e6

    def bucket(self, group: str, index: int, payload_bytes: int, queued_at: float,
               start: float, end: float) -> None:
        """Records bucket ``index`` of ``group``: handed over at ``queued_at``, run [start, end]."""
        common = {"pid": self.rank, "tid": "engine", "ph": "X"}
        self._events.append({**common, "name": f"wait {group}[{index}]", "cat": "wait",
                             "ts": self._us(queued_at), "dur": (start - queued_at) * 1e6})
        self._events.append({**common, "name": f"{group}[{index}]", "cat": group,
                             "ts": self._us(start), "dur": (end - start) * 1e6,
                             "args": {"bytes": payload_bytes, "bucket": index}})

    def events(self) -> list[dict]:
        return list(self._events)

    def write_at_exit(self, engine) -> None:
        """Registers the exit-time gather (a collective every rank runs) and rank 0's write."""
        atexit.register(self._gather_and_write, engine)

    def _gather_and_write(self, engine) -> None:
        events = self.events()
        per_rank = engine.call(lambda comm: comm.gather(events, root=0), label="timeline")
        if self.rank != 0:
            return
        names = [{"pid": r, "ph": "M", "name": "process_name", "args": {"name": f"rank {r}"}}
                 for r in range(len(per_rank))]
        write_trace(self.path, names + [e for rank_events in per_rank for e in rank_events])


def write_trace(path: str, events: list[dict]) -> None:
    """Writes ``events`` as a Chrome trace (``{"traceEvents": [...]}``) atomically."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".timeline-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(temporary, path)
