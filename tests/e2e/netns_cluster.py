"""A cluster of "hosts" on one machine, for end-to-end tests of the manager.

Each host is a Linux network namespace running its own real OpenSSH server with
throwaway keys; the manager under test runs in a separate "head" namespace.
Needs root, `ip` (iproute2), /usr/sbin/sshd, ssh-keygen; `slow_host` needs the
cgroup v1 cpu controller. Python 3 standard library only.

Topology (nothing is added to the root namespace except the namespace names)::

    head namespace  <prefix>-head   lo up, bridge br0 = 10.213.0.1/24
      |-- veth v0 <-> eth0 in <prefix>-h0   10.213.0.11/24, sshd on :22
      |-- veth v1 <-> eth0 in <prefix>-h1   10.213.0.12/24, sshd on :22
      ...

The prefix is `vh<pid>-<4 hex digits>`, so parallel runs never share a
namespace name. Every address lives only inside this cluster's namespaces,
which have their own interfaces and routing tables, so two clusters using the
same subnet and interface names never see each other. The head reaches every
host, hosts reach each other and the head; nothing reaches anything outside.
All namespaces share the file system, the user database and the host name with
the machine, so a path in the work directory means the same file on every host.

API
---
``Cluster(n_hosts: int, workdir: str)``
    Creates the namespaces, keys and sshds and returns once every sshd accepts
    TCP connections from the head namespace and each host holds only its
    listening sshd (raises ``ClusterError`` carrying sshd's log if one fails;
    setup takes ~0.2 s). Use it as a context manager, or call ``close()``;
    cleanup also runs at interpreter exit (atexit) and on SIGTERM/SIGHUP
    (unless ignored), then the previous signal disposition takes over. One
    cluster per workdir, whose path must not contain spaces, quotes or %.
    Attributes:

    - ``head_ns: str``, ``head_addr: str`` -- namespace and IP of the head
    - ``hosts: list[Host]`` -- ``Host`` has ``index`` (0-based), ``name`` (its
      namespace), ``addr``, ``sshd_port`` (22), ``sshd_log`` (path), ``alive``,
      ``cgroup`` (directory while slowed, else None); hashable by identity
    - ``identity_file: str`` -- ed25519 private key, no passphrase, authorised
      for root on every host
    - ``known_hosts_file: str`` -- plain known_hosts with every host key by IP
    - ``wrong_identity_file: str`` -- a valid key authorised nowhere
    - ``workdir: str`` -- keys, sshd configs and logs; never deleted by cleanup

``ns_cmd(ns, argv) -> list[str]``
    ``["ip", "netns", "exec", ns, *argv]``. Wherever a namespace is expected,
    a ``Host`` is accepted too.
``popen_in(ns, argv, **kw) -> subprocess.Popen``
    Starts a process inside a namespace (kw go to Popen). On a slowed host it
    joins the host's cpu cgroup before it execs.
``run_in(ns, argv, timeout=60, **kw) -> subprocess.CompletedProcess``
    Runs to completion; captures stdout and stderr as text unless kw says
    otherwise. Raises ``subprocess.TimeoutExpired`` after killing it.
``pids_in(ns) -> list[int]``
    Processes whose network namespace is ns (what ``ip netns pids`` lists).
``ssh_argv(host, command, *, identity_file=None, known_hosts_file=None, connect_timeout=5, options=()) -> list[str]``
    An OpenSSH client argv (strict host key checking, batch mode, no user
    config) for root on host; run it in the head namespace.
``kill_host(host)``
    Simulates the VM vanishing: takes the host's veth down, then SIGKILLs every
    process in its namespace including sshd. Nothing (no FIN, no RST) reaches
    the peers of its open connections, which only notice through their own
    heartbeats/keepalives; new connections time out, so clients need a
    connect timeout.
``restart_host(host)``
    After ``kill_host``: a fresh VM with the same address, MAC and host key
    (new namespace, new sshd, not slowed); returns when sshd accepts
    connections.
``stop_host_processes(host, pattern) -> list[int]``,
``cont_host_processes(host, pattern) -> list[int]``
    SIGSTOP / SIGCONT every process in the host's namespace whose command line
    (arguments joined by spaces) contains the substring pattern; returns pids.
``signal_host_processes(host, pattern, sig) -> list[int]``
    The same for any signal.
``slow_host(host, cpu_fraction: float)``
    Moves every current process of the host's namespace into a new cpu cgroup
    whose CFS quota is cpu_fraction of one core; their future children
    (sessions sshd forks, what those start) inherit it, as do processes
    started later with popen_in/run_in. Calling it again changes the quota.
    The cgroup is removed at cleanup. The host's sshd is slowed too, so ssh
    handshakes with it take visibly longer (as on a throttled VM).
``leftover_processes(timeout=3.0) -> list[tuple[str, int, str]]``
    ``(namespace, pid, cmdline)`` of every process in any of the cluster's
    namespaces except the listening sshds, waiting up to timeout seconds for
    the list to become empty (sessions take a moment to exit after their
    client does). Tests assert it is empty at the end.
``close()``
    Idempotent cleanup: SIGKILL everything in every namespace, reap, remove
    the cgroups, delete the namespaces (their veths and bridge go with them).
    SIGINT/SIGTERM are held off while it runs.

``reap_stale_clusters()`` removes namespaces and cgroups left behind by a run
whose process no longer exists (e.g. killed by a test timeout with SIGKILL);
the constructor calls it.
"""
from __future__ import annotations

import atexit
import dataclasses
import errno
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

log = logging.getLogger("netns_cluster")

SSHD = "/usr/sbin/sshd"
SUBNET = "10.213.0"          # a /24; see the module docstring for why it may be fixed
HEAD_OCTET = 1
FIRST_HOST_OCTET = 11
MAX_HOSTS = 254 - FIRST_HOST_OCTET + 1
SSHD_PORT = 22
READY_TIMEOUT_S = 20.0       # generous: the machine may be busy compiling
KILL_TIMEOUT_S = 5.0
CFS_PERIOD_US = 100_000
NETNS_DIR = "/var/run/netns"
CPU_CGROUP_MOUNTS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct")

_NAME_RE = re.compile(r"^vh(\d+)-[0-9a-f]{4}-(?:head|h\d+)$")

# Connects from the head namespace to every sshd until all accept or the
# deadline passes; proves both sshd and the bridge path are up.
_PROBE = r"""
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[1])
for target in sys.argv[2:]:
    host, port = target.rsplit(":", 1)
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
            break
        except OSError as e:
            if time.monotonic() > deadline:
                sys.exit(f"{target}: {e}")
            time.sleep(0.02)
"""


class ClusterError(RuntimeError):
    """Setting up or driving the cluster failed; the message says where."""


@dataclasses.dataclass(eq=False)   # identity: hashable, usable as a dict key
class Host:
    index: int
    name: str                 # network namespace name
    addr: str
    sshd_port: int = SSHD_PORT
    sshd_log: str = ""
    alive: bool = True        # False between kill_host and restart_host
    cgroup: str | None = None  # cpu cgroup directory while slowed (slow_host)


# ---------------------------------------------------------------- helpers

def _ip(*args: str) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def _netns_exists(ns: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, ns))


def _pids_in_netns(ns: str) -> list[int]:
    # Same test as `ip netns pids`: /proc/<pid>/ns/net is the namespace's nsfs
    # inode. Exited (zombie) processes have no namespace and are not listed.
    try:
        st = os.stat(os.path.join(NETNS_DIR, ns))
    except FileNotFoundError:
        return []
    key = (st.st_dev, st.st_ino)
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            s = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (s.st_dev, s.st_ino) == key:
            pids.append(int(entry))
    return sorted(pids)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def _kill_netns_processes(ns: str, reap=lambda: None, timeout: float = KILL_TIMEOUT_S) -> bool:
    """SIGKILLs everything in ns until it is empty; True if it emptied."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _pids_in_netns(ns)
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reap()  # lets our own killed children go (zombies are not listed, but should not pile up)
        if time.monotonic() > deadline:
            log.warning("processes survive SIGKILL in %s: %s", ns,
                        [(p, _cmdline(p)) for p in pids])
            return False
        time.sleep(0.01)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cpu_cgroup_base() -> str | None:
    """The cgroup v1 cpu directory this process lives in, or None."""
    mount = next((m for m in CPU_CGROUP_MOUNTS
                  if os.path.exists(os.path.join(m, "cpu.cfs_quota_us"))), None)
    if mount is None:
        return None
    rel = "/"
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "cpu" in controllers.split(","):
                rel = path
    return os.path.join(mount, rel.lstrip("/"))


def _rmdir_cgroup(path: str, timeout: float = 2.0) -> None:
    # EBUSY while killed tasks are still exiting.
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                log.warning("cannot remove cgroup %s: %s", path, e)
                return
        time.sleep(0.02)


def reap_stale_clusters() -> list[str]:
    """Deletes namespaces and cgroups of clusters whose owning process is gone."""
    removed = []
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        names = []
    for name in names:
        m = _NAME_RE.match(name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        log.warning("removing stale namespace %s (owner pid %s is gone)", name, m.group(1))
        _kill_netns_processes(name)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        removed.append(name)
    base = _cpu_cgroup_base()
    if base and os.path.isdir(base):
        for name in os.listdir(base):
            m = _NAME_RE.match(name)
            if m and not _pid_alive(int(m.group(1))):
                _rmdir_cgroup(os.path.join(base, name))
                removed.append(name)
    return removed


_sshd_knows_penalties: bool | None = None


def _sshd_supports_per_source_penalties(workdir: str, host_key: str) -> bool:
    # OpenSSH >= 9.8 refuses connections for a while from a source whose
    # authentication failed (PerSourcePenalties); the wrong-key tests must
    # not lock the head out. Older sshd rejects the option, so probe once.
    global _sshd_knows_penalties
    if _sshd_knows_penalties is None:
        cfg = os.path.join(workdir, "sshd_probe_config")
        with open(cfg, "w") as f:
            f.write(f"HostKey {host_key}\nPerSourcePenalties no\n")
        r = subprocess.run([SSHD, "-t", "-f", cfg], capture_output=True, text=True)
        _sshd_knows_penalties = r.returncode == 0
    return _sshd_knows_penalties


# ------------------------------------------------- process-wide cleanup hooks

# Clusters not yet closed. The hooks are installed once and clean all of them,
# so closing clusters in any order never leaves a stale handler chain.
_live: list["Cluster"] = []
_hooks_installed = False
_previous_handlers: dict[int, object] = {}
_HOOK_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _close_all() -> None:
    for cluster in list(_live):
        cluster.close()


def _on_signal(signum, frame) -> None:
    _close_all()
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        # Die of the signal as if we had never caught it.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread():
        for sig in _HOOK_SIGNALS:
            previous = signal.getsignal(sig)
            if previous == signal.SIG_IGN:
                continue   # e.g. SIGHUP under nohup: the cluster must survive it too
            _previous_handlers[sig] = previous
            signal.signal(sig, _on_signal)
    else:
        log.warning("cluster created off the main thread: no SIGTERM cleanup hook")
    _hooks_installed = True


# ------------------------------------------------------------------- cluster

class Cluster:
    """Owns the namespaces, sshd processes and cgroups of one test cluster.

    Not thread-safe: drive it from one thread (the signal hooks run on the
    main thread and only call close(), which is idempotent).
    """

    def __init__(self, n_hosts: int, workdir: str):
        if os.geteuid() != 0:
            raise ClusterError("netns_cluster needs root (network namespaces, sshd, cgroups)")
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise ClusterError(f"n_hosts={n_hosts}: must be between 1 and {MAX_HOSTS}")
        self.workdir = os.path.abspath(workdir)
        if re.search(r"[\s%\"]", self.workdir):
            # sshd_config splits AuthorizedKeysFile at spaces and expands %.
            raise ClusterError(f"workdir {self.workdir!r}: sshd_config cannot name paths with "
                               "spaces, quotes or %; use another directory")
        os.makedirs(self.workdir, exist_ok=True)
        self._prefix = f"vh{os.getpid()}-{secrets.token_hex(2)}"
        self.head_ns = f"{self._prefix}-head"
        self.head_addr = f"{SUBNET}.{HEAD_OCTET}"
        self.hosts = [
            Host(index=i, name=f"{self._prefix}-h{i}", addr=f"{SUBNET}.{FIRST_HOST_OCTET + i}",
                 sshd_log=os.path.join(self.workdir, f"sshd-h{i}.log"))
            for i in range(n_hosts)]
        keys = os.path.join(self.workdir, "keys")
        self.identity_file = os.path.join(keys, "id_ed25519")
        self.wrong_identity_file = os.path.join(keys, "wrong_id_ed25519")
        self.known_hosts_file = os.path.join(self.workdir, "known_hosts")
        self._authorized_keys = os.path.join(self.workdir, "authorized_keys")
        self._host_keys = [os.path.join(keys, f"ssh_host_ed25519_key_h{i}") for i in range(n_hosts)]
        self._namespaces: list[str] = []       # recorded before creation, so cleanup covers partial setup
        self._sshd: dict[int, subprocess.Popen] = {}
        self._sshd_logs: dict[int, object] = {}
        self._children: list[subprocess.Popen] = []
        self._closed = False

        _install_hooks()
        _live.append(self)
        try:
            reap_stale_clusters()
            started = time.monotonic()
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)   # sshd's privilege-separation dir
            self._make_keys(keys)
            self._make_head_network()
            for host in self.hosts:
                self._make_host_network(host)
            for host in self.hosts:
                self._start_sshd(host)
            self._wait_ready(self.hosts)
            log.info("cluster %s: %d hosts up in %.2f s", self._prefix, n_hosts,
                     time.monotonic() - started)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    # ---------------------------------------------------------------- setup

    def _make_keys(self, keydir: str) -> None:
        os.makedirs(keydir, exist_ok=True)
        targets = [(self.identity_file, "varuna-test-identity"),
                   (self.wrong_identity_file, "varuna-test-unauthorised")]
        targets += [(k, f"varuna-test-host-h{i}") for i, k in enumerate(self._host_keys)]
        procs = []
        for path, comment in targets:
            for stale in (path, path + ".pub"):   # ssh-keygen would ask before overwriting
                if os.path.exists(stale):
                    os.unlink(stale)
            procs.append((path, subprocess.Popen(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", path],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
        for path, p in procs:
            out, _ = p.communicate(timeout=30)
            if p.returncode != 0:
                raise ClusterError(f"ssh-keygen for {path} failed: {out.decode(errors='replace')}")

        with open(self.identity_file + ".pub") as f:
            pub = f.read()
        with open(self._authorized_keys, "w") as f:
            f.write(pub)
        os.chmod(self._authorized_keys, 0o600)
        with open(self.known_hosts_file, "w") as f:
            for host, key in zip(self.hosts, self._host_keys):
                with open(key + ".pub") as k:
                    key_type, key_data = k.read().split()[:2]
                f.write(f"{host.addr} {key_type} {key_data}\n")

    def _make_head_network(self) -> None:
        ns = self.head_ns
        self._namespaces.append(ns)
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", ns, "addr", "add", f"{self.head_addr}/24", "dev", "br0")
        _ip("-n", ns, "link", "set", "br0", "up")

    @staticmethod
    def _veth(host: Host) -> str:
        return f"v{host.index}"   # lives in the head namespace only

    def _make_host_network(self, host: Host) -> None:
        if host.name not in self._namespaces:
            self._namespaces.append(host.name)
        _ip("netns", "add", host.name)
        _ip("-n", host.name, "link", "set", "lo", "up")
        # Both ends are created directly inside their namespaces. A fixed MAC
        # survives restart_host, as a VM's NIC does; with a new one the head
        # would keep sending to the old MAC until its ARP entry expired.
        mac = f"02:0a:d5:00:00:{FIRST_HOST_OCTET + host.index:02x}"
        _ip("-n", self.head_ns, "link", "add", self._veth(host), "type", "veth",
            "peer", "name", "eth0", "address", mac, "netns", host.name)
        _ip("-n", self.head_ns, "link", "set", self._veth(host), "master", "br0", "up")
        _ip("-n", host.name, "addr", "add", f"{host.addr}/24", "dev", "eth0")
        _ip("-n", host.name, "link", "set", "eth0", "up")

    def _sshd_config(self, host: Host) -> str:
        path = os.path.join(self.workdir, f"sshd_config-h{host.index}")
        lines = [
            f"ListenAddress {host.addr}:{host.sshd_port}",
            f"HostKey {self._host_keys[host.index]}",
            f"PidFile {os.path.join(self.workdir, f'sshd-h{host.index}.pid')}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "StrictModes no",
            f"AuthorizedKeysFile {self._authorized_keys}",
            "UsePAM no",
            "UseDNS no",
            "PrintMotd no",
            # The manager may open many sessions at once; the defaults
            # (10:30:100, 10) would randomly drop some.
            "MaxStartups 200",
            "MaxSessions 200",
            "LogLevel VERBOSE",
            "Subsystem sftp internal-sftp",
        ]
        if _sshd_supports_per_source_penalties(self.workdir, self._host_keys[host.index]):
            lines.append("PerSourcePenalties no")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def _start_sshd(self, host: Host) -> None:
        config = self._sshd_config(host)
        logf = open(host.sshd_log, "ab")
        self._sshd_logs[host.index] = logf
        logf.write(f"---- {time.strftime('%H:%M:%S')} starting sshd in {host.name}\n".encode())
        logf.flush()
        # -D: stay in the foreground so this Popen is the listener; -e: log to
        # the file. A new session keeps terminal Ctrl-C away from it: cleanup,
        # not the terminal, decides when it dies.
        self._sshd[host.index] = subprocess.Popen(
            self.ns_cmd(host.name, [SSHD, "-D", "-e", "-f", config]),
            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        host.alive = True

    def _read_log(self, host: Host) -> str:
        try:
            with open(host.sshd_log, errors="replace") as f:
                return f.read()
        except OSError as e:
            return f"<cannot read {host.sshd_log}: {e}>"

    def _wait_ready(self, hosts: list[Host], settle: bool = True) -> None:
        probe = self.popen_in(
            self.head_ns,
            [sys.executable, "-c", _PROBE, str(READY_TIMEOUT_S)]
            + [f"{h.addr}:{h.sshd_port}" for h in hosts],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + READY_TIMEOUT_S + 5
        try:
            while probe.poll() is None:
                for h in hosts:   # fail fast, with its log, if an sshd dies
                    rc = self._sshd[h.index].poll()
                    if rc is not None:
                        raise ClusterError(f"sshd in {h.name} ({h.addr}) exited with {rc}; "
                                           f"its log {h.sshd_log}:\n{self._read_log(h)}")
                if time.monotonic() > deadline:
                    raise ClusterError("readiness probe from the head namespace hung")
                time.sleep(0.02)
            _, err = probe.communicate()
            if probe.returncode != 0:
                logs = "\n".join(f"--- {h.sshd_log}:\n{self._read_log(h)}" for h in hosts)
                raise ClusterError(f"sshd not reachable from {self.head_ns} within "
                                   f"{READY_TIMEOUT_S} s: {err.strip()}\n{logs}")
            # The probe's connections leave sshd children that exit once they
            # see the close; wait for them so callers start with only the
            # listeners in the hosts. Not after restart_host: a client that
            # retries the host (a manager) may connect the moment sshd listens.
            for h in (hosts if settle else []):
                listener = self._sshd[h.index].pid
                while self.pids_in(h) != [listener]:
                    if time.monotonic() > deadline:
                        raise ClusterError(f"{h.name}: processes besides sshd {listener}: "
                                           f"{[(p, _cmdline(p)) for p in self.pids_in(h)]}")
                    time.sleep(0.01)
        finally:
            if probe.poll() is None:
                probe.kill()
                probe.wait()
            self._children.remove(probe)

    # ------------------------------------------------------------ processes

    @staticmethod
    def _ns_name(ns) -> str:
        return ns.name if isinstance(ns, Host) else ns

    def ns_cmd(self, ns, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self._ns_name(ns), *argv]

    def _launch_argv(self, ns, argv: list[str]) -> list[str]:
        ns = self._ns_name(ns)
        cmd = self.ns_cmd(ns, argv)
        host = next((h for h in self.hosts if h.name == ns), None)
        if host is not None and host.cgroup:
            # Join the cgroup before exec so nothing it forks escapes the quota.
            procs = os.path.join(host.cgroup, "cgroup.procs")
            cmd = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *cmd]
        return cmd

    def popen_in(self, ns, argv: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(self._launch_argv(ns, argv), **kw)
        self._children.append(p)
        return p

    def run_in(self, ns, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        if not {"stdout", "stderr", "capture_output"} & kw.keys():
            kw["capture_output"] = True
        if not {"text", "universal_newlines", "encoding", "errors"} & kw.keys():
            kw["text"] = True
        return subprocess.run(self._launch_argv(ns, argv), timeout=timeout, **kw)

    def pids_in(self, ns) -> list[int]:
        return _pids_in_netns(self._ns_name(ns))

    def ssh_argv(self, host: Host, command: list[str], *, identity_file: str | None = None,
                 known_hosts_file: str | None = None, connect_timeout: float = 5,
                 options: tuple[str, ...] | list[str] = ()) -> list[str]:
        """OpenSSH client argv for root@host; the remote shell parses command."""
        opts = ["-F", "/dev/null",   # no user config or default identities
                "-i", identity_file or self.identity_file,
                "-o", "IdentitiesOnly=yes",
                "-o", f"UserKnownHostsFile={known_hosts_file or self.known_hosts_file}",
                "-o", "GlobalKnownHostsFile=/dev/null",
                "-o", "StrictHostKeyChecking=yes",
                "-o", "BatchMode=yes",
                "-o", f"ConnectTimeout={int(connect_timeout) if connect_timeout >= 1 else 1}",
                "-p", str(host.sshd_port)]
        for o in options:
            opts += ["-o", o]
        return ["ssh", *opts, f"root@{host.addr}", *command]

    def _reap_children(self) -> None:
        for p in list(self._sshd.values()) + self._children:
            p.poll()

    def signal_host_processes(self, host: Host, pattern: str, sig: int) -> list[int]:
        hit = []
        for pid in self.pids_in(host):
            if pattern in _cmdline(pid):
                try:
                    os.kill(pid, sig)
                    hit.append(pid)
                except ProcessLookupError:
                    pass
        return hit

    def stop_host_processes(self, host: Host, pattern: str) -> list[int]:
        return self.signal_host_processes(host, pattern, signal.SIGSTOP)

    def cont_host_processes(self, host: Host, pattern: str) -> list[int]:
        return self.signal_host_processes(host, pattern, signal.SIGCONT)

    # --------------------------------------------------------------- faults

    def kill_host(self, host: Host) -> None:
        # Link down first: the dying processes' FIN/RST must not reach anyone,
        # as when a VM is deallocated.
        _ip("-n", self.head_ns, "link", "set", self._veth(host), "down")
        _kill_netns_processes(host.name, self._reap_children)
        sshd = self._sshd.pop(host.index, None)
        if sshd is not None:
            sshd.wait(timeout=KILL_TIMEOUT_S)
        host.alive = False
        log.info("killed host %s (%s)", host.name, host.addr)

    def restart_host(self, host: Host) -> None:
        if host.alive:
            raise ClusterError(f"restart_host({host.name}): host is alive; kill_host it first")
        # A new namespace drops the old one's sockets, like a new VM would.
        _kill_netns_processes(host.name, self._reap_children)
        if host.cgroup:
            _rmdir_cgroup(host.cgroup)
            host.cgroup = None
        # The old veth pair would go with the old namespace, but the kernel
        # frees a deleted namespace asynchronously (later still while sockets
        # its processes left linger): delete the pair itself, or its name is
        # still taken when the new one is created.
        subprocess.run(["ip", "-n", self.head_ns, "link", "del", self._veth(host)], capture_output=True)
        subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
        self._make_host_network(host)
        self._start_sshd(host)
        self._wait_ready([host], settle=False)
        log.info("restarted host %s (%s)", host.name, host.addr)

    def slow_host(self, host: Host, cpu_fraction: float) -> None:
        if not cpu_fraction > 0:
            raise ClusterError(f"slow_host({host.name}, {cpu_fraction}): fraction must be > 0")
        base = _cpu_cgroup_base()
        if base is None:
            raise ClusterError("slow_host needs the cgroup v1 cpu controller mounted at one of "
                               f"{CPU_CGROUP_MOUNTS} (cgroup v2 is not supported)")
        path = host.cgroup or os.path.join(base, host.name)
        os.makedirs(path, exist_ok=True)
        host.cgroup = path
        with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
            f.write(str(CFS_PERIOD_US))
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(max(1000, int(cpu_fraction * CFS_PERIOD_US))))
        # Repeat until a pass finds nothing outside: a process forking during
        # a pass may leave a child behind in the old cgroup.
        procs = os.path.join(path, "cgroup.procs")
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while True:
            with open(procs) as f:
                inside = {int(x) for x in f.read().split()}
            outside = [p for p in self.pids_in(host) if p not in inside]
            if not outside:
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"slow_host({host.name}): cannot move {outside} into {path}")
            for pid in outside:
                try:
                    with open(procs, "w") as f:
                        f.write(str(pid))
                except OSError as e:
                    if e.errno != errno.ESRCH:
                        raise
        log.info("host %s limited to %.2f of a core", host.name, cpu_fraction)

    # -------------------------------------------------------------- checks

    def leftover_processes(self, timeout: float = 3.0) -> list[tuple[str, int, str]]:
        deadline = time.monotonic() + timeout
        while True:
            self._reap_children()
            listeners = {p.pid for p in self._sshd.values()}
            left = [(ns, pid, _cmdline(pid)) for ns in self._namespaces
                    for pid in _pids_in_netns(ns) if pid not in listeners]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    # ------------------------------------------------------------- cleanup

    def close(self) -> None:
        if self._closed:
            return
        # Each step is idempotent, so an interrupted close can simply run
        # again; holding off SIGINT/SIGTERM makes that rare.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for ns in reversed(self._namespaces):
                _kill_netns_processes(ns, self._reap_children)
            for p in list(self._sshd.values()) + self._children:
                if p.poll() is None:   # e.g. still between fork and setns
                    p.kill()
                try:
                    p.wait(timeout=KILL_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    log.warning("pid %d does not die", p.pid)
            for f in self._sshd_logs.values():
                f.close()
            for host in self.hosts:
                if host.cgroup:
                    _rmdir_cgroup(host.cgroup)
                    host.cgroup = None
            for ns in reversed(self._namespaces):
                if _netns_exists(ns):
                    r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
                    if r.returncode != 0 and _netns_exists(ns):
                        log.warning("cannot delete namespace %s: %s", ns, r.stderr.strip())
            self._closed = True
            if self in _live:
                _live.remove(self)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
