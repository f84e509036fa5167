"""What happened when, during one backward: the recorder every data-parallel wrapper here fills in.

    recorder = Timeline(bucket_names, bucket_bytes)   # or NoTimeline() to record nothing
    recorder.ready(name, bucket)        # a gradient arrived
    recorder.launched(bucket, work)     # a bucket's all_reduce started (its completion comes from work's future)
    recorder.span(name, lane, start, end)   # a collective of a sharded step, from start to end
    recorder.finished()                 # every averaged gradient is in place
    recorder.events                     # the dict trace.py draws (Chrome trace, PNG)

Times are time.perf_counter() seconds; trace.py turns them into microseconds from the forward's start.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional


class Timeline:
    """Records one backward's events on this rank, for the bucket layout it was built with.

    The DDP wrapper calls ready() as each gradient arrives, launched() as each bucket's
    all_reduce starts, and finished() when the averaged gradients are in place. `events` is the
    dict that write_chrome_trace() and plot_timeline() draw.
    """

    def __init__(self, bucket_names: List[List[str]], bucket_bytes: List[int]):
        self.events: Dict = {"start": time.perf_counter(), "ready": [], "launch": {}, "done": {}, "end": None,
                             "buckets": bucket_names, "bytes": bucket_bytes, "spans": []}

    def ready(self, name: str, bucket: int) -> None:
        self.events["ready"].append((name, bucket, time.perf_counter()))

    def launched(self, bucket: int, work) -> None:
        events = self.events
        events["launch"][bucket] = time.perf_counter()
        future = work.get_future()
        if future is not None:  # completion as the backend reports it, not when we waited
            future.then(lambda _: events["done"].__setitem__(bucket, time.perf_counter()))

    def finished(self) -> None:
        self.events["end"] = time.perf_counter()

    def span(self, name: str, lane: str, start: float, end: float) -> None:
        """A collective that ran from start to end (the sharded steps record theirs this way)."""
        self.events["spans"].append((name, lane, start, end))


class NoTimeline(Timeline):
    """timeline=False: records nothing (a benchmark row measures what recording costs)."""

    def __init__(self, *_):
        self.events: Optional[Dict] = None

    def ready(self, name: str, bucket: int) -> None:
        pass

    def launched(self, bucket: int, work) -> None:
        pass

    def finished(self) -> None:
        pass

    def span(self, name: str, lane: str, start: float, end: float) -> None:
        pass
