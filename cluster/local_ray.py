"""A Ray this process started for itself (a benchmark, a test session), and stopping only that one.

`ray.init` joins nothing when Ray already runs in the process (someone else's driver, a caller's
cluster), so whoever calls `start` remembers whether it was the one that started Ray; `shutdown`
then stops Serve and Ray only in that case and leaves a Ray it found running alone.
"""
from __future__ import annotations


class StartedRay:
    def __init__(self) -> None:
        self.started = False

    def start(self, **init_kwargs) -> None:
        """`ray.init(**init_kwargs)` unless Ray is already initialised in this process."""
        import ray

        if not ray.is_initialized():
            self.started = True
            ray.init(**init_kwargs)

    def shutdown(self) -> None:
        """Stop Serve and Ray if `start` started them (once; later calls do nothing)."""
        if self.started:
            import ray
            from ray import serve

            self.started = False
            serve.shutdown()
            ray.shutdown()
