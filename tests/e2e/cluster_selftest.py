#!/usr/bin/env python3
"""Self-test of the network-namespace cluster harness (netns_cluster.py). Root only.

Creates a 3-host cluster and checks, with the real OpenSSH client run in the
head namespace: every host answers over ssh and owns its address; the wrong
key and a known_hosts without the host's key are refused; hosts reach each
other and the head; stop/cont and slow_host act on a host's processes;
kill_host makes ssh fail within the connect timeout and restart_host brings
the host back; leftover_processes sees a stray process. After the cluster is
closed (normally, by an exception, and by SIGTERM in a child process) no
namespace, process or cgroup of it remains. Exits non-zero naming each failed
check.
"""
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns_cluster  # noqa: E402

T0 = time.monotonic()
SKIP = 77   # CTest SKIP_RETURN_CODE
failures = []
passed = 0

BUSY = """
import sys, time
start = time.process_time()   # interpreter start-up is not part of the figure
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
print(time.process_time() - start)
"""

TCP_SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
s.settimeout(20)
c, peer = s.accept()
c.sendall(b"hello " + peer[0].encode())
c.close()
"""

TCP_CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as s:
    print(s.recv(100).decode())
"""


def progress(message):
    print(f"[cluster_selftest {time.monotonic() - T0:5.1f}s] {message}", flush=True)


def check(condition, message):
    global passed
    if condition:
        passed += 1
    else:
        failures.append(message)
        progress(f"FAIL: {message}")
    return condition


def netns_names():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def read_line(stream, timeout):
    """One line from a pipe, or '' if none arrives before the deadline."""
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    try:
        return stream.readline() if sel.select(timeout) else ""
    finally:
        sel.close()


def ssh(cluster, host, command, **kw):
    return cluster.run_in(cluster.head_ns, cluster.ssh_argv(host, command, **kw), timeout=30)


def tcp_roundtrip(cluster, server_ns, server_addr, client_ns):
    server = cluster.popen_in(server_ns, [sys.executable, "-c", TCP_SERVER, server_addr],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = read_line(server.stdout, 10).strip()
        if not port:
            return f"server in {server_ns} did not start: {server.stderr.read() if server.poll() is not None else ''}"
        r = cluster.run_in(client_ns, [sys.executable, "-c", TCP_CLIENT, server_addr, port], timeout=15)
        return r.stdout.strip() if r.returncode == 0 else f"client failed: {r.stderr.strip()}"
    finally:
        server.kill()
        server.wait()


def pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def wait_state(pid, states, timeout=5):
    """The process's state once it is one of states (signals act asynchronously)."""
    deadline = time.monotonic() + timeout
    while proc_state(pid) not in states and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc_state(pid)


def main_cluster_checks(workdir):
    names = sshd_pids = cgroups = None
    progress("creating Cluster(3)")
    t = time.monotonic()
    with netns_cluster.Cluster(3, workdir) as c:
        progress(f"cluster up in {time.monotonic() - t:.2f} s: head {c.head_ns} {c.head_addr}, "
                 + ", ".join(f"{h.name} {h.addr}" for h in c.hosts))
        names = {c.head_ns} | {h.name for h in c.hosts}
        check(names <= netns_names(), f"namespaces {names} not all in `ip netns list`")
        sshd_pids = {pid for h in c.hosts for pid in c.pids_in(h)}
        check(len(sshd_pids) == 3, f"expected one sshd per host, found {sshd_pids}")

        for h in c.hosts:
            r = ssh(c, h, ["echo", "ok"])
            check(r.returncode == 0 and r.stdout.strip() == "ok",
                  f"ssh {h.addr} echo ok: rc {r.returncode}, out {r.stdout!r}, err {r.stderr!r}")
            r = ssh(c, h, ["ip", "-4", "-o", "addr", "show"])
            others = [o.addr for o in c.hosts if o is not h] + [c.head_addr]
            check(r.returncode == 0 and f"inet {h.addr}/" in r.stdout
                  and not any(f"inet {a}/" in r.stdout for a in others),
                  f"ip addr over ssh on {h.addr} does not show exactly its own address: {r.stdout!r}")
        progress("every host answers over ssh with its own address")

        h0, h1, h2 = c.hosts
        r = ssh(c, h0, ["echo", "ok"], identity_file=c.wrong_identity_file)
        check(r.returncode == 255 and "Permission denied" in r.stderr,
              f"wrong key not refused: rc {r.returncode}, err {r.stderr!r}")
        others_only = os.path.join(workdir, "known_hosts_without_h0")
        with open(c.known_hosts_file) as src, open(others_only, "w") as dst:
            dst.writelines(line for line in src if not line.startswith(h0.addr + " "))
        r = ssh(c, h0, ["echo", "ok"], known_hosts_file=others_only)
        check(r.returncode == 255 and "Host key verification failed" in r.stderr,
              f"unknown host key not refused: rc {r.returncode}, err {r.stderr!r}")
        progress("wrong key and unknown host key are refused")

        got = tcp_roundtrip(c, h1, h1.addr, h2)
        check(got == f"hello {h2.addr}", f"h2 -> h1 TCP: {got!r}")
        got = tcp_roundtrip(c, c.head_ns, c.head_addr, h0)
        check(got == f"hello {h0.addr}", f"h0 -> head TCP: {got!r}")
        got = tcp_roundtrip(c, h0, h0.addr, c.head_ns)
        check(got == f"hello {c.head_addr}", f"head -> h0 TCP: {got!r}")
        for ns in (c.head_ns, h0.name):
            routes = c.run_in(ns, ["ip", "-4", "route", "show", "table", "all"]).stdout
            outside = [line for line in routes.splitlines()
                       if not line.startswith(("10.213.", "local 10.213.", "broadcast 10.213.",
                                               "local 127.", "broadcast 127.", "127."))]
            check(not outside, f"{ns} has routes beyond its own subnet: {outside}")
        progress("hosts reach each other and the head, and nothing else")

        sleeper = c.popen_in(h2, ["sleep", "60"])
        deadline = time.monotonic() + 5   # `ip netns exec` enters the namespace, then execs sleep
        while sleeper.pid not in c.pids_in(h2) or not cmdline(sleeper.pid).startswith("sleep"):
            if not check(time.monotonic() < deadline, "popen_in: sleep never appeared in the namespace"):
                break
            time.sleep(0.01)
        stopped = c.stop_host_processes(h2, "sleep 60")
        check(stopped == [sleeper.pid], f"stop_host_processes matched {stopped}, want [{sleeper.pid}]")
        state = wait_state(sleeper.pid, "T")
        check(state == "T", f"stopped sleep is in state {state}")
        c.cont_host_processes(h2, "sleep 60")
        state = wait_state(sleeper.pid, "SR")
        check(state in "SR", f"continued sleep is in state {state}")
        left = c.leftover_processes(timeout=0)
        check((h2.name, sleeper.pid, "sleep 60") in left,
              f"leftover_processes does not list the stray sleep {sleeper.pid}: {left}")
        sleeper.kill()
        sleeper.wait()
        left = c.leftover_processes()
        check(left == [], f"leftover_processes after killing the stray sleep: {left}")
        progress("stop/cont and leftover detection work")

        busy = os.path.join(workdir, "busy.py")
        with open(busy, "w") as f:
            f.write(BUSY)
        c.slow_host(h1, 0.1)
        cgroups = [h1.cgroup]
        check(h1.cgroup and os.path.isdir(h1.cgroup), f"slow_host made no cgroup: {h1.cgroup!r}")
        # Started through sshd, so the slowed one inherits the cgroup from the listener.
        loops = {h: c.popen_in(c.head_ns, c.ssh_argv(h, ["python3", busy, "1.5"]),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for h in (h1, h2)}
        cpu = {}
        for h, p in loops.items():
            out, err = p.communicate(timeout=30)
            cpu[h.name] = float(out) if p.returncode == 0 else -1.0
            check(p.returncode == 0, f"busy loop on {h.addr} failed: {err!r}")
        slowed, normal = cpu[h1.name], cpu[h2.name]
        progress(f"CPU seconds in 1.5 s wall: slowed host (0.1 core) {slowed:.3f}, "
                 f"normal host {normal:.3f}, ratio {slowed / normal if normal > 0 else float('nan'):.2f}")
        check(0 < slowed < 0.6 * normal, f"slow_host: slowed {slowed:.3f} s vs normal {normal:.3f} s")
        r = c.run_in(h1, [sys.executable, "-c", "print(open('/proc/self/cgroup').read())"])
        check(f"/{h1.name}\n" in r.stdout,
              f"run_in on a slowed host is outside its cgroup: {r.stdout!r}")

        c.kill_host(h0)
        check(c.pids_in(h0) == [], f"processes left in killed host: {c.pids_in(h0)}")
        t = time.monotonic()
        r = ssh(c, h0, ["echo", "ok"], connect_timeout=2)
        took = time.monotonic() - t
        progress(f"ssh to killed host: rc {r.returncode} after {took:.2f} s: {r.stderr.strip()}")
        check(r.returncode == 255 and took < 5, f"ssh to killed host: rc {r.returncode} after {took:.2f} s")
        r = ssh(c, h2, ["echo", "ok"])
        check(r.stdout.strip() == "ok", f"other host broken by kill_host: {r.stderr!r}")

        c.restart_host(h0)
        r = ssh(c, h0, ["echo", "ok"])
        check(r.returncode == 0 and r.stdout.strip() == "ok", f"restarted host: {r.stderr!r}")
        got = tcp_roundtrip(c, h0, h0.addr, h1)
        check(got == f"hello {h1.addr}", f"h1 -> restarted h0 TCP: {got!r}")
        sshd_pids |= set(c.pids_in(h0))
        progress("kill_host makes ssh fail fast; restart_host brings the host back")

        left = c.leftover_processes()
        check(left == [], f"leftover processes before exit: {left}")

    alive = [pid for pid in sshd_pids if pid_alive(pid)]
    check(not alive, f"sshd pids alive after close: {alive}")
    check(not (names & netns_names()), f"namespaces left after close: {names & netns_names()}")
    check(not any(os.path.exists(p) for p in cgroups or []), f"cgroup left after close: {cgroups}")
    stray = [line for line in subprocess.run(["ps", "-eo", "pid,args"], capture_output=True,
                                             text=True).stdout.splitlines() if workdir in line]
    check(not stray, f"processes still using the workdir: {stray}")
    progress("after close: no namespace, process or cgroup left")


def exception_check(workdir):
    names = set()
    try:
        with netns_cluster.Cluster(1, workdir) as c:
            names = {c.head_ns, c.hosts[0].name}
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    check(names and not (names & netns_names()), f"namespaces left after an exception: {names & netns_names()}")
    progress("cleanup runs on an exception")


def sigterm_check(workdir):
    script = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
              "import netns_cluster\n"
              f"c = netns_cluster.Cluster(1, {workdir!r})\n"
              "print(c.head_ns, c.hosts[0].name, *c.pids_in(c.hosts[0]), flush=True)\n"
              "sys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = read_line(child.stdout, 30).split()
        if not check(len(line) == 3, f"SIGTERM child did not come up: {line}"):
            return
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=20)
        check(child.returncode == -signal.SIGTERM, f"SIGTERM child exited with {child.returncode}")
        check(not (set(line[:2]) & netns_names()), f"namespaces left after SIGTERM: {line[:2]}")
        check(not pid_alive(int(line[2])), f"sshd {line[2]} alive after SIGTERM")
        progress("cleanup runs on SIGTERM")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def main():
    if os.geteuid() != 0:
        print("cluster_selftest: skipped, needs root (network namespaces, sshd, cgroups)", file=sys.stderr)
        return SKIP
    missing = [tool for tool in ("ip", "ssh", "ssh-keygen", netns_cluster.SSHD) if not shutil.which(tool)]
    if missing:
        print(f"cluster_selftest: skipped, missing {missing}", file=sys.stderr)
        return SKIP
    workdir = tempfile.mkdtemp(prefix="cluster_selftest-")
    try:
        main_cluster_checks(os.path.join(workdir, "main"))
        exception_check(os.path.join(workdir, "exception"))
        sigterm_check(os.path.join(workdir, "sigterm"))
    except Exception as e:  # a harness error is a failure with its message, not a trace
        failures.append(f"{type(e).__name__}: {e}")
    progress(f"{passed} checks passed, {len(failures)} failed")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        print(f"logs kept in {workdir}", file=sys.stderr)
        return 1
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
