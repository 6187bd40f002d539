"""Network namespaces standing in for hosts: every node of a chaos run on a "host" of its own.

With `ecshare chaos --netns`, each producer and consumer process runs in a
network namespace of its own, with one device, `ecs0`, the end of a veth pair
whose other end sits on a bridge in a hub namespace. The harness's fault
proxies listen in the hub, on the bridge's address, so control goes from a
consumer's host through the hub to a producer's host, and NIXL's reads go from
host to host across the bridge over UCX's TCP transport: two veth devices and a
bridge, a network stack each way, where on one namespace UCX would use
cross-memory attach.

It needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's `ip`;
`hosts_unavailable` says what is missing. A child enters its namespace with
setns(2) before it opens any socket. A fault proxy's thread enters the hub the
same way: setns moves the calling thread only, so the harness itself stays
where it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
from dataclasses import dataclass

SUBNET = "10.79.0"
HUB_IP = f"{SUBNET}.1"
DEVICE = "ecs0"  # every host's one device; names are per namespace
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000
_MNT_DETACH = 2
_NETNS_DIR = "/var/run/netns"  # where `ip netns add` mounts a namespace


class HostsUnavailable(Exception):
    pass


@dataclass(frozen=True)
class Host:
    netns: str
    ip: str
    hub_device: str  # its veth end on the bridge, in the hub


def _libc_call(what: str, result: int) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter_namespace(name: str) -> None:
    """Move the calling thread, and the threads it starts from now on, into `name`."""
    # os.setns arrived in Python 3.12.
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(_NETNS_DIR, name), os.O_RDONLY)
    try:
        _libc_call(f"cannot enter network namespace {name}", libc.setns(fd, _CLONE_NEWNET))
    finally:
        os.close(fd)


def become_host(name: str) -> None:
    """`enter_namespace`, and a /sys of its own that shows the namespace's devices.

    UCX finds network devices under /sys/class/net, which shows the devices of
    the namespace that mounted it; `ip netns exec` remounts it the same way.
    Only this thread (and those it starts) sees the new mount.
    """
    enter_namespace(name)
    libc = ctypes.CDLL(None, use_errno=True)
    _libc_call("cannot unshare the mount namespace", libc.unshare(_CLONE_NEWNS))
    _libc_call(
        "cannot make mounts private", libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)
    )
    _libc_call("cannot unmount /sys", libc.umount2(b"/sys", _MNT_DETACH))
    _libc_call("cannot mount sysfs", libc.mount(name.encode(), b"/sys", b"sysfs", 0, None))


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


class Hosts:
    """A hub namespace with a bridge, and namespaces joined to it (`add`); `close` removes all."""

    def __init__(self, tag: str) -> None:
        if shutil.which("ip") is None:
            raise HostsUnavailable("iproute2's `ip` command is not installed")
        self._prefix = f"ecs-{tag}"
        self.hub = f"{self._prefix}-hub"
        self._namespaces: list[str] = []
        self._hosts: list[Host] = []
        self._free: list[Host] = []
        try:
            self._add_namespace(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "addr", "add", f"{HUB_IP}/24", "dev", "br0")
            _ip("-n", self.hub, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add(self) -> Host:
        """A host for a new process: a fresh one, or one a dead process gave back."""
        if self._free:
            return self._free.pop()
        n = len(self._hosts) + 2
        if n > 254:
            raise HostsUnavailable(f"no address left in {SUBNET}.0/24")
        host = Host(f"{self._prefix}-{n}", f"{SUBNET}.{n}", f"v{n}")
        self._add_namespace(host.netns)
        _ip("-n", self.hub, "link", "add", host.hub_device, "type", "veth",
            "peer", "name", DEVICE, "netns", host.netns)  # fmt: skip
        _ip("-n", self.hub, "link", "set", host.hub_device, "master", "br0")
        _ip("-n", self.hub, "link", "set", host.hub_device, "up")
        _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", DEVICE)
        _ip("-n", host.netns, "link", "set", DEVICE, "up")
        self._hosts.append(host)
        return host

    def give_back(self, host: Host) -> None:
        """`host`'s process is gone: a later process may have its namespace and address."""
        self._free.append(host)

    def bytes_sent(self, host: Host) -> int:
        """Bytes `host` has sent through its device (its veth end on the bridge received)."""
        done = subprocess.run(
            ["ip", "-n", self.hub, "-j", "-s", "link", "show", "dev", host.hub_device],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode:
            return 0
        return int(json.loads(done.stdout)[0]["stats64"]["rx"]["bytes"])

    @property
    def hosts(self) -> list[Host]:
        return list(self._hosts)

    def close(self) -> None:
        # Deleting a namespace deletes its devices, and with them the veth pairs.
        for name in reversed(self._namespaces):
            with contextlib.suppress(HostsUnavailable, subprocess.TimeoutExpired):
                _ip("netns", "del", name)
        self._namespaces.clear()


def hosts_unavailable() -> str | None:
    """Why a run with --netns cannot be set up here, or None when it can."""
    try:
        hosts = Hosts(f"probe{os.getpid()}")
    except HostsUnavailable as exc:
        return str(exc)
    try:
        hosts.add()
    except HostsUnavailable as exc:
        return str(exc)
    finally:
        hosts.close()
    return None
