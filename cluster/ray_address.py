"""Failing fast on a Ray address where nothing listens.

Given `host:port` (a GCS address) with nothing behind it, Ray's clients wait for the GCS: about 40 s
for the Jobs API client, and `ray.init` retries for minutes. A TCP connect answers in milliseconds,
and so does a port that listens but speaks no gRPC.
"""
from __future__ import annotations

import os
import socket


class ClusterUnreachable(ConnectionError):
    """Nothing answers at the Ray address given."""


def _host_port(address: str | None) -> tuple[str, int] | None:
    """(host, port) of `host:port` or `ray://host:port`; None for other forms (`auto`, `http://`, None)."""
    bare = (address or "").strip()
    bare = bare[len("ray://"):] if bare.lower().startswith("ray://") else bare
    host, sep, port = bare.rpartition(":")
    if not sep or "://" in bare or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def check_listening(address: str | None, timeout: float = 5.0) -> None:
    """ClusterUnreachable naming the address when `host:port` or `ray://host:port` refuses, does not
    resolve, or does not answer within `timeout` (Ray's client waits about 30 s for a Ray Client
    address); other forms (`auto`, `http://`, None) are left to Ray, which answers them at once."""
    target = _host_port(address)
    if target is None:
        return
    try:
        socket.create_connection(target, timeout=timeout).close()
    except TimeoutError:
        raise ClusterUnreachable(f"no answer from {address} within {timeout:g} s") from None
    except OSError as e:
        raise ClusterUnreachable(f"{e.strerror or e} at {address}") from None


# HTTP/2's client preface and an empty SETTINGS frame: a gRPC server (Ray's GCS, the Ray Client
# server) answers with a SETTINGS frame of its own before anything else
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def check_speaks_grpc(address: str | None, timeout: float = 2.0) -> None:
    """ClusterUnreachable when `host:port` (or `ray://host:port`) answers, but not as a gRPC server
    does: an SSH, database or HTTP/1 port, where Ray would wait for a GCS for 40 s to minutes. Silence
    is left to Ray (a slow GCS), and so is a cluster with TLS, which this plain-text probe cannot ask."""
    target = _host_port(address)
    if target is None or os.environ.get("RAY_USE_TLS", "").strip().lower() in ("1", "true"):
        return
    try:
        sock = socket.create_connection(target, timeout=timeout)
    except OSError:           # check_listening's to answer
        return
    with sock:
        try:
            sock.sendall(_H2_PREFACE)
            answer = sock.recv(64)
        except TimeoutError:
            return
        except OSError:       # reset or closed while asked: a gRPC server does not
            answer = b""
    if len(answer) >= 9 and answer[3] == 0x04 and answer[5:9] == b"\x00\x00\x00\x00":   # SETTINGS, stream 0
        return
    said = f"it said {answer[:24]!r}" if answer else "it closed the connection without a word"
    raise ClusterUnreachable(f"{address} answers, but not as a Ray cluster (a GCS or Ray Client port speaks gRPC; "
                             f"{said}): the GCS is usually :6379, the dashboard :8265")
