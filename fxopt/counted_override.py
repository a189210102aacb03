"""A process-wide setting changed while any of its users runs, put back when the last one leaves.

Python's GIL switch interval (codegen/gil_handoff.py) and its cyclic garbage collector (gc_pause.py) are
one per process, while compile phases that want them changed overlap on several threads: the first to
enter changes the setting, the last to leave restores it, on any thread.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable


class CountedOverride:
    """`apply()` runs when the first user enters and returns what `restore(token)` needs after the last
    leaves. An `apply` that raises lets its user in nowhere: the count is unchanged."""

    def __init__(self, apply: Callable[[], object], restore: Callable[[object], None]):
        self._apply, self._restore = apply, restore
        self._lock = threading.Lock()
        self.active = 0  # users inside now (tests read it)
        self._token = None

    @contextlib.contextmanager
    def __call__(self):
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def enter(self) -> None:
        """One user in (for callers whose start and end are two callbacks, not one block)."""
        with self._lock:
            if self.active == 0:
                self._token = self._apply()
            self.active += 1

    def leave(self) -> None:
        """One user out; the last one restores the setting."""
        with self._lock:
            self.active -= 1
            if self.active == 0:
                self._restore(self._token)
                self._token = None
