"""Failing fast on a Ray address where nothing listens.

Given `host:port` (a GCS address) with nothing behind it, Ray's clients wait for the GCS: about 40 s
for the Jobs API client, and `ray.init` retries for minutes. A TCP connect answers in milliseconds.
"""
from __future__ import annotations

import socket


class ClusterUnreachable(ConnectionError):
    """Nothing answers at the Ray address given."""


def check_listening(address: str | None, timeout: float = 5.0) -> None:
    """ClusterUnreachable naming the address when `host:port` (no scheme) refuses, does not resolve, or does not
    answer within `timeout`; other forms (`auto`, `ray://`, `http://`, None) are left to Ray."""
    host, sep, port = (address or "").strip().rpartition(":")
    if not sep or "://" in address or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except TimeoutError:
        raise ClusterUnreachable(f"no answer from {address} within {timeout:g} s") from None
    except OSError as e:
        raise ClusterUnreachable(f"{e.strerror or e} at {address}") from None
