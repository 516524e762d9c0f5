"""Failing fast on a Ray address where nothing listens.

Given `host:port` (a GCS address) with nothing behind it, Ray's clients wait for the GCS: about 40 s
for the Jobs API client, and `ray.init` retries for minutes. A TCP connect answers in milliseconds.
"""
from __future__ import annotations

import socket


class ClusterUnreachable(ConnectionError):
    """Nothing answers at the Ray address given."""


def check_listening(address: str | None, timeout: float = 5.0) -> None:
    """ClusterUnreachable naming the address when `host:port` or `ray://host:port` refuses, does not
    resolve, or does not answer within `timeout` (Ray's client waits about 30 s for a Ray Client
    address); other forms (`auto`, `http://`, None) are left to Ray, which answers them at once."""
    bare = (address or "").strip()
    bare = bare[len("ray://"):] if bare.lower().startswith("ray://") else bare
    host, sep, port = bare.rpartition(":")
    if not sep or "://" in bare or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except TimeoutError:
        raise ClusterUnreachable(f"no answer from {address} within {timeout:g} s") from None
    except OSError as e:
        raise ClusterUnreachable(f"{e.strerror or e} at {address}") from None
