"""What the main thread was doing, sampled: its Python stack every few milliseconds from a daemon
thread (`sys._current_frames`), for `first_call_profile --timeline --sample-main`. cProfile sees only
calls that finish and their own time; a thread blocked inside a C call (a lock, a subprocess, the
GIL) shows here as the Python frame that made the call, which is what a timeline gap needs."""
from __future__ import annotations

import collections
import os
import sys
import threading
import time


class MainThreadSampler:
    def __init__(self, interval: float = 0.005, depth: int = 4):
        self.interval, self.depth = interval, depth
        self.samples: list[tuple[float, tuple[str, ...]]] = []
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="main-thread-sampler")

    def start(self) -> "MainThreadSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self._main)
            if frame is not None:
                self.samples.append((time.perf_counter(), stack_of(frame, self.depth)))

    def slices(self, t0: float, width: float = 0.2) -> list[str]:
        """One line per `width` seconds since t0: the slice's most frequent stack and its share."""
        by_slice: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        for t, stack in self.samples:
            by_slice[int((t - t0) / width)][stack] += 1
        lines = []
        for i in sorted(by_slice):
            counts = by_slice[i]
            stack, n = counts.most_common(1)[0]
            lines.append(f"{i * width:6.2f}-{(i + 1) * width:5.2f} s  {n}/{sum(counts.values())}  {' < '.join(stack)}")
        return lines


def stack_of(frame, depth: int) -> tuple[str, ...]:
    """The innermost `depth` frames as file:function:line, innermost first."""
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return tuple(out)
