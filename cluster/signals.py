"""SIGINT/SIGTERM handling shared by the long-running processes: `eaglectl serve` (cluster/serve_app.py)
and the job driver (jobs/runner.py). Plain Python, no Ray: the job driver imports it too."""
from __future__ import annotations

import signal
import threading
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)   # Ctrl-C, and what Kubernetes / `ray job stop` send


def on_stop_signals(handler: Callable[[str], None]) -> dict:
    """Call `handler(signal name)` on SIGINT and SIGTERM, replacing whatever handler (or ignore) the
    process inherited or a library installed; returns the handlers replaced, for `restore_signals`.
    Signal handlers live in the main thread only: elsewhere this does nothing and returns {}."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def on_signal(signum, frame):
        handler(signal.Signals(signum).name)

    return {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}


def restore_signals(previous: dict) -> None:
    """Put back the handlers `on_stop_signals` replaced."""
    for sig, h in previous.items():
        signal.signal(sig, h)
