"""A shaped-network testbed: one Linux network namespace per worker, real links, real rates.

    diloco testbed configs/tiny.yaml --workers 4 --up 20 --down 20   # 4 workers on 20 Mbit/s links
    launch/testbed.sh configs/tiny.yaml --workers 4 --rate 5          # the same, from the shell

Each worker gets a namespace joined to the root namespace by a veth pair whose root end sits on
a bridge; the bootstrap peer listens on the bridge's address. Every link is shaped with
``tc ... tbf`` (``netem`` does not exist on these machines): the namespace end's egress is the
worker's upload, the root end's egress its download, so both directions are limited
separately and traffic between two workers crosses two shaped links, as between two sites.

``nat`` puts chosen workers behind a home router of their own: a router namespace between the
worker and the bridge that masquerades the worker's traffic (``iptables``) and drops every
connection coming in from outside, as a home router without forwarded ports does. Such a worker
listens on its private address (``address``); the others see it at its router's (``public_address``)
and cannot dial it. Two NAT'd workers cannot dial each other.

Needs root and iproute2 (``ip``, ``tc``), and ``iptables`` for NAT; without them ``Testbed``
raises ``TestbedError`` (one line). Everything carries the creating process's id in its name;
``close()`` (also on error, Ctrl-C and SIGTERM, since the CLI turns those into exceptions) kills
what runs in the namespaces and deletes them, their veths and the bridge, and ``remove_stale()`` clears what a testbed
killed with -9 left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

_NETNS_ETC = Path("/etc/netns")  # per-namespace files that ``ip netns exec`` mounts over /etc's
_NAME = re.compile(r"^dl[bvpn]([0-9a-z]+)s")  # every testbed object: dl + kind + owner pid (base 36) + s + number
_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"
_SPLIT_CHAIN = "diloco-split"  # split()'s rules, in each worker's namespace
_built = 0  # testbeds built by this process so far: each gets fresh names


def _base36(number: int) -> str:
    digits = ""
    while True:
        number, digit = divmod(number, 36)
        digits = _BASE36[digit] + digits
        if number == 0:
            return digits


class TestbedError(RuntimeError):
    """The testbed cannot run here (not root, no iproute2); one line, user-fixable."""

    __test__ = False  # not a pytest test class


def testbed_unavailable(*, nat: bool = False) -> str | None:
    """Why a testbed (``nat``: with workers behind NAT) cannot be built on this machine, or None."""
    if os.geteuid() != 0:
        return "the network testbed needs root (network namespaces, veth pairs and tc); run it as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the network testbed needs iproute2 ({' and '.join(missing)} not found); install iproute2"
    if nat and shutil.which("iptables") is None:
        return "a testbed with workers behind NAT needs iptables; install it (apt-get install iptables)"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def _burst_bytes(mbit: float) -> int:
    """tbf's bucket: 10 ms at the rate, at least 64 KiB (veths hand tbf segments that large)."""
    return max(64 * 1024, int(mbit * 1e6 / 8 / 100))


class Testbed:
    """``workers`` network namespaces on shaped links to a bridge in the root namespace.

    ``up_mbit`` / ``down_mbit`` are each worker's link rate in Mbit/s (0 = not shaped).
    """

    __test__ = False  # not a pytest test class

    def __init__(self, workers: int, *, up_mbit: float, down_mbit: float, nat: Sequence[int] = ()):
        if (reason := testbed_unavailable(nat=bool(nat))) is not None:
            raise TestbedError(reason)
        if any(not 0 <= i < workers for i in nat):
            raise TestbedError(f"nat={list(nat)}: workers are numbered 0 to {workers - 1}")
        if not 1 <= workers <= 99:
            raise TestbedError(f"--workers={workers}: the testbed holds 1 to 99 workers")
        global _built
        _built += 1
        self.workers = workers
        self.up_mbit, self.down_mbit = up_mbit, down_mbit
        tag = f"{_base36(os.getpid())}s{_built % 100}"  # names stay within 15 characters
        subnet = 1 + (os.getpid() * 7 + _built) % 250  # one /24 per testbed, so that two can run side by side
        self._tag = tag
        self._bridge = f"dlb{tag}"
        self._prefix = f"10.231.{subnet}"
        self.host = f"{self._prefix}.1"  # the root namespace's address on the bridge
        self._namespaces = [f"dln{tag}w{i}" for i in range(workers)]
        self._root_ends = [f"dlv{tag}x{i}" for i in range(workers)]
        self.nat = sorted(set(nat))
        self._routers = {i: f"dln{tag}r{i}" for i in self.nat}  # a NAT'd worker's home router
        self._closed = False
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        def rate(mbit: float) -> str:
            return f"{mbit:g} Mbit/s" if mbit > 0 else "unshaped"

        return f"up {rate(self.up_mbit)}, down {rate(self.down_mbit)}"

    def address(self, worker: int) -> str:
        """The worker's address inside its namespace (behind NAT: private, on its home network)."""
        return f"192.168.{50 + worker}.2" if worker in self._routers else self.public_address(worker)

    def public_address(self, worker: int) -> str:
        """Where the others see the worker: its own address, or its home router's behind NAT."""
        return f"{self._prefix}.{10 + worker}"

    def namespace(self, worker: int) -> str:
        return self._namespaces[worker]

    def command(self, worker: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the worker's namespace (``ip netns exec`` execs it: same process)."""
        return ["ip", "netns", "exec", self._namespaces[worker], *argv]

    def _build(self) -> None:
        remove_stale()
        _run("ip", "link", "add", self._bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.host}/24", "dev", self._bridge)
        _run("ip", "link", "set", self._bridge, "up")
        for i, (namespace, root_end) in enumerate(zip(self._namespaces, self._root_ends)):
            # the namespace on the bridge: the worker's own, or its home router's
            outer = self._routers.get(i, namespace)
            inside = f"dlp{self._tag}x{i}"
            _run("ip", "netns", "add", namespace)
            _no_resolver(namespace)
            if outer != namespace:
                _run("ip", "netns", "add", outer)
            _run("ip", "link", "add", root_end, "type", "veth", "peer", "name", inside)
            _run("ip", "link", "set", inside, "netns", outer)
            _run("ip", "link", "set", root_end, "master", self._bridge, "up")
            _run("ip", "-n", outer, "addr", "add", f"{self.public_address(i)}/24", "dev", inside)
            _run("ip", "-n", outer, "link", "set", inside, "up")
            _run("ip", "-n", outer, "link", "set", "lo", "up")
            _run("ip", "-n", outer, "route", "add", "default", "via", self.host)
            self._shape(["tc", "-n", outer], inside, self.up_mbit)
            self._shape(["tc"], root_end, self.down_mbit)
            if outer != namespace:
                self._build_home(i, router=outer, wan=inside)

    def _build_home(self, worker: int, *, router: str, wan: str) -> None:
        """The worker's home network behind ``router``: masqueraded out through ``wan``, nothing in."""
        namespace, lan, home = self._namespaces[worker], f"dlv{self._tag}l{worker}", f"dlp{self._tag}l{worker}"
        gateway = f"192.168.{50 + worker}.1"
        _run("ip", "-n", router, "link", "add", lan, "type", "veth", "peer", "name", home)
        _run("ip", "-n", router, "link", "set", home, "netns", namespace)
        _run("ip", "-n", router, "addr", "add", f"{gateway}/24", "dev", lan)
        _run("ip", "-n", router, "link", "set", lan, "up")
        _run("ip", "-n", namespace, "addr", "add", f"{self.address(worker)}/24", "dev", home)
        _run("ip", "-n", namespace, "link", "set", home, "up")
        _run("ip", "-n", namespace, "link", "set", "lo", "up")
        _run("ip", "-n", namespace, "route", "add", "default", "via", gateway)
        iptables = ["ip", "netns", "exec", router, "iptables"]
        _run("ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        _run(*iptables, "-t", "nat", "-A", "POSTROUTING", "-o", wan, "-j", "MASQUERADE")
        _run(
            *iptables, "-A", "FORWARD", "-i", wan, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"
        )
        _run(*iptables, "-A", "FORWARD", "-i", wan, "-j", "DROP")  # no connection from outside gets in
        _run(*iptables, "-A", "INPUT", "-i", wan, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _run(*iptables, "-A", "INPUT", "-i", wan, "-j", "DROP")

    @staticmethod
    def _shape(tc: list[str], device: str, mbit: float) -> None:
        if mbit > 0:
            burst = _burst_bytes(mbit)
            rate = ["rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms"]
            _run(*tc, "qdisc", "replace", "dev", device, "root", "tbf", *rate)

    def set_rate(self, worker: int, *, up_mbit: float, down_mbit: float) -> None:
        """Reshape one worker's link (a slow volunteer among fast ones)."""
        outer = self._routers.get(worker, self._namespaces[worker])
        self._shape(["tc", "-n", outer], f"dlp{self._tag}x{worker}", up_mbit)
        self._shape(["tc"], self._root_ends[worker], down_mbit)

    def set_link(self, worker: int, up: bool) -> None:
        """Cut (``up=False``) or restore a worker's link, as a network outage would."""
        _run("ip", "link", "set", self._root_ends[worker], "up" if up else "down")

    def split(self, sides: Sequence[Sequence[int]], *, bootstrap_side: int = 0) -> None:
        """Cut the network between ``sides`` (lists of workers), as a failed link between two sites
        would: each worker drops every packet to or from a worker of another side, and from the root
        namespace (where the bootstrap peer listens) unless it is on ``bootstrap_side``. Links within
        a side stay. ``heal()`` undoes it. The rules sit in a chain of their own in each namespace."""
        flat = [w for side in sides for w in side]
        if sorted(flat) != sorted(set(flat)) or any(not 0 <= w < self.workers for w in flat):
            raise TestbedError(f"split {[list(s) for s in sides]}: each worker 0 to {self.workers - 1} in one side")
        self.heal()
        for number, side in enumerate(sides):
            away = [self.public_address(w) for other in sides if other is not side for w in other]
            if number != bootstrap_side:
                away.append(self.host)
            for worker in side:
                iptables = ["ip", "netns", "exec", self._routers.get(worker, self._namespaces[worker]), "iptables"]
                _run(*iptables, "-N", _SPLIT_CHAIN, check=False)  # exists after an earlier split
                for hook in ("INPUT", "OUTPUT", "FORWARD"):
                    if _run(*iptables, "-C", hook, "-j", _SPLIT_CHAIN, check=False).returncode != 0:
                        _run(*iptables, "-I", hook, "-j", _SPLIT_CHAIN)
                for address in away:
                    _run(*iptables, "-A", _SPLIT_CHAIN, "-s", address, "-j", "DROP")
                    _run(*iptables, "-A", _SPLIT_CHAIN, "-d", address, "-j", "DROP")

    def heal(self) -> None:
        """Undo ``split()``: every worker reaches every other again."""
        for worker in range(self.workers):
            namespace = self._routers.get(worker, self._namespaces[worker])
            _run("ip", "netns", "exec", namespace, "iptables", "-F", _SPLIT_CHAIN, check=False)

    def close(self) -> None:
        """Kill whatever runs in the namespaces, then delete them, their veths and the bridge. Idempotent."""
        if self._closed:
            return
        self._closed = True
        namespaces = [*self._namespaces, *self._routers.values()]
        for namespace in namespaces:
            _kill_inside(namespace)
        for namespace in namespaces:
            _run("ip", "netns", "del", namespace, check=False)
            shutil.rmtree(_NETNS_ETC / namespace, ignore_errors=True)
        for root_end in self._root_ends:
            _run("ip", "link", "del", root_end, check=False)  # deleting the namespace frees it, but lazily
        _run("ip", "link", "del", self._bridge, check=False)
        _wait_gone({*namespaces, *self._root_ends, self._bridge})

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_REC, _MS_SLAVE, _MS_BIND = 0x4000, 0x80000, 0x1000


def enter_namespace(namespace: str) -> None:
    """Move this process into ``namespace``'s network, as ``ip netns exec`` does before it execs:
    setns(2) into it, then a mount namespace of its own with ``/etc/netns/NAME``'s files over
    ``/etc``'s (the resolver, ``_no_resolver``); ``/sys`` is not remounted (nothing here reads it).
    Everything the process starts afterwards is there too."""
    libc = ctypes.CDLL(None, use_errno=True)

    def call(result: int, what: str) -> None:
        if result != 0:
            error = ctypes.get_errno()
            raise TestbedError(f"cannot enter namespace {namespace}: {what}: {os.strerror(error)}")

    descriptor = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        call(libc.setns(descriptor, _CLONE_NEWNET), "setns")
    finally:
        os.close(descriptor)
    call(libc.unshare(_CLONE_NEWNS), "unshare")
    call(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    folder = _NETNS_ETC / namespace
    for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
        source, target = str(entry).encode(), str(Path("/etc") / entry.name).encode()
        call(libc.mount(source, target, b"none", _MS_BIND, None), f"bind {entry} over /etc")


def _no_resolver(namespace: str) -> None:
    """Name lookups inside ``namespace`` fail at once. The machine's DNS server is out of reach
    there, so each lookup would wait out its timeouts (10 s): gloo's store looks up the name of
    every client that connects, which made the first worker that starts one 10 s late for its
    first round. ``ip netns exec`` puts the files of /etc/netns/NAME over /etc's."""
    folder = _NETNS_ETC / namespace
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    except OSError as error:  # a read-only /etc: lookups stay slow, and the testbed works all the same
        logger.warning("name lookups in the testbed's namespaces wait for the DNS server's timeouts: %s", error)


def _kill_inside(namespace: str) -> None:
    pids = _run("ip", "netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _running(pid)]
        if pids:
            time.sleep(0.05)  # the kernel ends SIGKILLed processes promptly; bounded by the deadline


def _running(pid: str) -> bool:
    """Whether process ``pid`` still runs: not gone, and not a zombie (dead, waiting for its parent to
    reap it: the launcher's own children stay so until it waits for them, and hold nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def leftovers() -> list[str]:
    """Names of testbed namespaces, links and namespace files that exist now (of any owner)."""
    names = _run("ip", "netns", "list", check=False).stdout.split()
    links = re.findall(r"^\d+: ([^:@]+)", _run("ip", "-o", "link", "show", check=False).stdout, re.MULTILINE)
    files = [path.name for path in _NETNS_ETC.iterdir()] if _NETNS_ETC.is_dir() else []  # _no_resolver's
    return sorted({name for name in [*names, *links, *files] if _NAME.match(name)})


def remove_stale() -> list[str]:
    """Delete the namespaces and links of testbeds whose owner process is gone; return their names."""
    removed = []
    for name in leftovers():
        owner = int(_NAME.match(name).group(1), 36)
        if os.path.exists(f"/proc/{owner}"):
            continue
        if name.startswith("dln"):
            _kill_inside(name)
            _run("ip", "netns", "del", name, check=False)
            shutil.rmtree(_NETNS_ETC / name, ignore_errors=True)
        else:
            _run("ip", "link", "del", name, check=False)
        removed.append(name)
    _wait_gone(set(removed))
    return removed


def _wait_gone(names: set[str], timeout_s: float = 5.0) -> None:
    """Until the kernel has finished deleting ``names`` (it deletes a namespace's veths lazily)."""
    deadline = time.monotonic() + timeout_s
    while names & set(leftovers()) and time.monotonic() < deadline:
        time.sleep(0.05)
