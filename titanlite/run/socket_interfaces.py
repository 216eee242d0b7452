"""The network interfaces NCCL and gloo bootstrap over: `NCCL_SOCKET_IFNAME` and `GLOO_SOCKET_IFNAME`.

On a cluster node with several interfaces (Ethernet for management, InfiniBand, docker bridges) NCCL and
gloo may pick one the other nodes cannot reach, and the launch hangs until the init timeout. The user names
the interface in these variables; they reach every rank unchanged (the scheduler exports the job's
environment to `srun`, `run_train.sh` to the launcher, torch's agent copies the launcher's environment
into each rank it starts). The launcher's preflight refuses a name this node does not have, in one line
(exit code 2) before any rank starts, instead of a hang or a trace per rank; rank 0 logs the settings.

NCCL reads a comma-separated list of name prefixes (`ib` matches `ib0`), `=` before the list for exact
names and `^` to exclude names; gloo a comma-separated list of exact names.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from titanlite.errors import ConfigError

VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def problem(var: str, value: str, interfaces: list[str]) -> str | None:
    """Why `var`=`value` names no usable interface among `interfaces`, or None."""
    if var == "NCCL_SOCKET_IFNAME":
        if value.startswith("^"):  # an exclusion list: anything else may be used
            return None
        exact = value.startswith("=")
        names = [n for n in value.lstrip("=").split(",") if n]
        if any(i == n or (not exact and i.startswith(n)) for n in names for i in interfaces):
            return None
        return "matches no interface of this node" if names else "is empty"
    missing = [n for n in value.split(",") if n not in interfaces]
    return f"names {', '.join(repr(n) for n in missing)}, which this node does not have" if missing else None


def check(environ: Mapping[str, str], interfaces: list[str] | None = None) -> None:
    """Raise `ConfigError` naming the variable and this node's interfaces if one names none of them."""
    have = interfaces if interfaces is not None else [name for _, name in socket.if_nameindex()]
    for var in VARIABLES:
        value = environ.get(var)
        if value is not None and (why := problem(var, value, have)):
            raise ConfigError(f"{var}={value} {why} (its interfaces: {', '.join(have)})")


def describe(environ: Mapping[str, str]) -> str | None:
    """The settings for rank 0's log, or None when neither is set."""
    set_ = [f"{var}={environ[var]}" for var in VARIABLES if var in environ]
    return f"network interfaces: {', '.join(set_)}" if set_ else None
