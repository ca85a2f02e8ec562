"""Addresses: where a client on this machine reaches a server bound to a host.

One rule for every URL rtk builds (Triton's HTTP, gRPC and metrics ports, the front door): a server
bound to every address is reached on loopback, and an IPv6 address is bracketed.
"""

from __future__ import annotations


def connect_host(host: str) -> str:
    """``0.0.0.0`` / ``""`` -> ``127.0.0.1``, ``::`` -> ``[::1]``, ``::1`` -> ``[::1]``, names unchanged."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def http_url(host: str, port: int) -> str:
    return f"http://{connect_host(host)}:{port}"


def grpc_address(host: str, port: int) -> str:
    """``host:port`` as tritonclient's gRPC client takes it."""
    return f"{connect_host(host)}:{port}"


class Endpoints:
    """URLs of a Triton server from its ``host``, ``http_port``, ``grpc_port`` and ``metrics_port`` attributes
    (mixed into the serving spec, the live server and its state file)."""

    @property
    def http_url(self) -> str:
        return http_url(self.host, self.http_port)

    @property
    def grpc_url(self) -> str:
        return grpc_address(self.host, self.grpc_port)

    @property
    def metrics_url(self) -> str:
        return f"{http_url(self.host, self.metrics_port)}/metrics"
