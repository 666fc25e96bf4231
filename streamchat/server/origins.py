"""Which Host and Origin headers name this daemon: loopback names, allowed hosts, its own pages' origins."""

from __future__ import annotations

import ipaddress


def is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_allowed(host: str, allowed_hosts: tuple[str, ...]) -> bool:
    """Whether a Host header (`name[:port]`, `[v6][:port]`) names loopback or an allowed host."""
    host = host.lower()
    name = host[1:].partition("]")[0] if host.startswith("[") else host.partition(":")[0]
    return is_loopback(name) or name in (h.lower() for h in allowed_hosts)


def self_origins(bind_host: str, port: int) -> set[str]:
    """The Origin of pages the daemon serves itself, as browsers write it (no :80 for port 80)."""
    names = {"127.0.0.1", "localhost", "[::1]"}
    if bind_host:  # "" binds every interface and names none
        names.add(f"[{bind_host}]" if ":" in bind_host else bind_host.lower())
    suffix = "" if port == 80 else f":{port}"
    return {f"http://{name}{suffix}" for name in names}
