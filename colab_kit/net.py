"""Where colab_kit's own sockets listen: loopback only, unless a multi-host run names an address.

Three kinds of listening socket come up when ranks start, and each is pinned here:

    what                         who opens it        bound to (local runs)
    rendezvous store (TCPStore)  launch's parent,    127.0.0.1, through a socket bound first and
                                 or a cluster's      handed over (``master_listen_fd``): torch's
                                 rank 0              own bind would take every interface
    gloo's pair sockets          every rank          the loopback interface (``GLOO_SOCKET_IFNAME``)
    ipyparallel's controller     the kernel          127.0.0.1 (``controller_ip``)

Worked example, ``ck.launch(fn, 2)`` on a host whose name resolves to 10.0.0.5::

    parent   store   127.0.0.1:41234    (never 0.0.0.0:41234 or [::]:41234)
    rank 0   gloo    127.0.0.1:50001    (GLOO_SOCKET_IFNAME=lo: not 10.0.0.5:50001)
    rank 1   gloo    127.0.0.1:50002

A multi-host cluster (``engines="mpi" | "ssh" | "slurm"``) names its address explicitly
(``ck.Cluster(..., ip="10.0.0.5")``); then the store and the controller listen on that
address and gloo on the interface the host picked for its hostname (docs/network.md).
"""
from __future__ import annotations

import socket
from datetime import timedelta

__all__ = ["LOOPBACK", "is_loopback", "loopback_interface", "interface_for", "listening_store", "gloo_env"]

LOOPBACK = "127.0.0.1"


def is_loopback(addr: str) -> bool:
    return addr in ("localhost", "::1") or addr.startswith("127.")


def loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return next((n for n in names if n.startswith("lo")), "lo")


def gloo_env(addr: str) -> dict[str, str]:
    """Environment that puts gloo's listening sockets where the peers reach them (gloo otherwise binds to
    whatever the hostname resolves to, often 127.0.1.1): loopback when ``addr`` (the rendezvous) is a
    loopback address, else the interface of this host that routes to ``addr`` (``interface_for``); nothing
    where it cannot be told, or where the user set ``GLOO_SOCKET_IFNAME``."""
    import os
    if "GLOO_SOCKET_IFNAME" in os.environ and not is_loopback(addr):
        return {}
    if is_loopback(addr):
        return {"GLOO_SOCKET_IFNAME": loopback_interface()}
    name = interface_for(addr)
    return {"GLOO_SOCKET_IFNAME": name} if name is not None and name != loopback_interface() else {}


def interface_for(addr: str) -> str | None:
    """The name of this host's interface whose address routes to ``addr`` (the rendezvous address), or
    None where it cannot be told (not Linux, no route)."""
    try:
        target = socket.gethostbyname(addr)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # UDP: nothing is sent, the kernel only picks the route
            local = s.getsockname()[0]
    except OSError:
        return None
    if is_loopback(local):
        return loopback_interface()
    try:
        import fcntl
        import struct
    except ImportError:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == local:
            return name
    return None


def listening_store(addr: str, world_size: int, timeout: float):
    """A master ``TCPStore`` that listens on ``addr`` only, on a port the OS picks.

    ``torch.distributed.TCPStore(addr, 0, is_master=True)`` uses ``addr`` for clients but
    binds its server to every interface; binding the socket here and handing it over
    keeps it where it was asked to be.
    """
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, 0))
        sock.listen(max(128, 2 * world_size))
        store = dist.TCPStore(addr, sock.getsockname()[1], world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout), master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now (and closes it with the store)
    return store
