"""Per-bucket communication statistics kept by the engine (read by ``strategy.stats()``)."""

from __future__ import annotations

import collections
import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class BucketRecord:
    """One posted bucket: what it carried and when (``time.perf_counter`` seconds)."""

    group: str
    index: int
    payload_bytes: int
    queued_at: float
    start: float
    end: float


class CommStats:
    """A bounded log of the last buckets the engine ran. Thread-safe."""

    def __init__(self, max_records: int = 4096):
        self._records: collections.deque[BucketRecord] = collections.deque(maxlen=max_records)
        self._lock = threading.Lock()

    def record_bucket(self, group: str, index: int, payload_bytes: int, *, queued_at: float,
                      start: float, end: float) -> None:
        with self._lock:
            self._records.append(BucketRecord(group, index, payload_bytes, queued_at, start, end))

    def records(self) -> list[BucketRecord]:
        with self._lock:
            return list(self._records)
