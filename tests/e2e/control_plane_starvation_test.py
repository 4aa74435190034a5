#!/usr/bin/env python3
"""The auditor's control-plane starvation case, end to end on loopback.

run_varuna runs a small job (three loopback "hosts", 127.0.0.1-3, one slot
each: 2 stages x 1 replica on two of them, the third a spare) with
RLIMIT_NOFILE=256 (soft and hard, so its own raise to the hard limit does not
help it). Then, all at once, from 127.0.0.0/8 only:

- 400 idle sockets (connect, send nothing);
- 50 sockets that send a frame header announcing a large frame (half of them
  1,000,000 bytes, just under the protocol's 1 MiB limit, half 12,000, under
  the manager's 16 KiB limit for a first frame) and then trickle a few bytes
  every 100 ms;
- 100 hellos with a wrong token and huge host fields (half 900 kB, over the
  first-frame limit; half 14 kB of non-ASCII UTF-8, under it, so they reach
  the token check and its log line);
- 20 malformed first frames: JSON with bytes that are not UTF-8 (a parser's
  error quotes them; they once ended the manager through the event log).

While that goes on:

- a valid `notify_manager_preempt` (for the spare host, so the job does not
  morph), sent at once and again halfway through the hello deadline, is
  acknowledged within 2 s each time;
- the manager's CPU (utime + stime from /proc/<pid>/stat) stays under 30% of
  a core averaged over the attack;
- its event log grows by less than 64 KiB and its output by less than 256 KiB
  (nothing a peer sends is logged unbounded);
- every attacking socket is closed by the manager within the hello deadline
  (5 s) plus a margin, and its descriptors go back to what they were;

The control plane is TLS (control_tls.h): none of those bytes is a TLS
ClientHello, so each fails the handshake at once or waits out the deadline.

Then 10,000 TLS 1.3 handshakes without the job's credential (Python's ssl
offers no pre-shared key, so the manager, which has no certificate, ends each
one), 16 connections at a time: the manager lives, a valid notice sent in the
middle of them is acknowledged within 2 s, and events.jsonl grows by a few
summary lines that count them, not 10,000.

Afterwards the manager is alive, the job still trains (steps advance) and
stops cleanly on SIGTERM with nothing left behind.
"""
import json
import os
import resource
import signal
import socket
import ssl
import struct
import sys
import tempfile
import shutil
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from varuna_e2e import Manager, assert_nothing_left, log, run_tests, wait_for  # noqa: E402

ROOT = Path(os.environ.get("VARUNA_TEST_TMPDIR", tempfile.mkdtemp(prefix="varuna-starvation-")))
shutil.rmtree(ROOT, ignore_errors=True)
ROOT.mkdir(parents=True)
THREE_HOSTS = ["127.0.0.1 slots=1", "127.0.0.2 slots=1", "127.0.0.3 slots=1"]
SPARE = "127.0.0.3"
_port = [20000 + (os.getpid() % 150) * 40]  # master ports, below the ephemeral range (32768-)

FILE_LIMIT = 256
IDLE, SLOW, BAD_HELLOS, GARBAGE = 400, 50, 100, 20
HELLO_DEADLINE_S = 5.0  # docs/run_varuna.md
ATTACK_S = HELLO_DEADLINE_S + 3.0
MAX_ACK_S = 2.0
MAX_CPU = 0.30
MAX_EVENT_GROWTH = 64 * 1024
MAX_OUTPUT_GROWTH = 256 * 1024
MANY_BAD_HELLOS, BAD_HELLO_SENDERS = 10_000, 16
MAX_EVENT_LINES_FOR_MANY = 8


def cpu_seconds(pid):
    """utime + stime of a process, in seconds (/proc/<pid>/stat fields 14, 15)."""
    stat = Path("/proc/%d/stat" % pid).read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_fds(pid):
    try:
        return len(os.listdir("/proc/%d/fd" % pid))
    except OSError:
        return -1


def frame(body):
    return struct.pack(">I", len(body)) + body


class Attack:
    """The attacking sockets and the thread that feeds them (non-blocking, so a
    manager that never reads costs the attacker nothing either)."""

    def __init__(self, port):
        self.port = port
        self.idle, self.slow, self.hellos, self.garbage = [], [], [], []
        self.outgoing = {}  # socket -> bytes still to send
        self.stop = threading.Event()
        self.thread = None
        self.opened_at = None

    def _connect(self):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", self.port))  # EINPROGRESS; loopback completes it in the kernel
        return s

    def open(self):
        self.opened_at = time.monotonic()
        for _ in range(IDLE):
            self.idle.append(self._connect())
        for i in range(SLOW):
            s = self._connect()
            self.slow.append(s)
            self.outgoing[s] = struct.pack(">I", 1_000_000 if i % 2 == 0 else 12_000)
        for i in range(BAD_HELLOS):
            s = self._connect()
            self.hellos.append(s)
            host = ("h" * 900_000) if i % 2 == 0 else ("\u00e9" * 7_000)  # 900 kB ASCII, or 14 kB of UTF-8
            body = json.dumps({"type": "hello", "version": 2, "token": "0" * 48, "role": "worker",
                               "host": host, "rank": 0, "generation": 1}, ensure_ascii=False).encode()
            self.outgoing[s] = frame(body)
        for i in range(GARBAGE):
            s = self._connect()
            self.garbage.append(s)
            self.outgoing[s] = frame(b'{"type": "hello", "host": "' + b"\xff\xfe" * (1000 + i) + b'"}')
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            for s in list(self.outgoing):
                data = self.outgoing[s]
                try:
                    sent = s.send(data[:65536])
                except BlockingIOError:
                    continue
                except OSError:  # closed by the manager: fine
                    del self.outgoing[s]
                    continue
                self.outgoing[s] = data[sent:]
                if not self.outgoing[s]:
                    del self.outgoing[s]
            for s in self.slow:  # a trickle of the announced frame's body
                if s not in self.outgoing:
                    self.outgoing[s] = b"x" * 8
            self.stop.wait(0.1)

    def closed_by_peer(self, sockets):
        """How many of `sockets` the manager has closed (EOF or reset)."""
        closed = 0
        for s in sockets:
            try:
                while s.recv(65536):  # a refused hello gets an ack first
                    pass
                closed += 1
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        return closed

    def close(self):
        self.stop.set()
        if self.thread:
            self.thread.join()
        for s in self.idle + self.slow + self.hellos + self.garbage:
            s.close()


def send_bad_hellos(port, count, refused):
    """`count` TLS 1.3 handshakes without the job's credential (no
    certificate), one connection each; appends each one the manager ended (a
    TLS alert, or the connection closed, with no answer) to `refused`. In TLS
    1.3 a client's half of the handshake is over before the server has
    checked its certificate, so the refusal comes at the first read; an
    answer to the hello would be a hole."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    hello = frame(json.dumps({"type": "hello", "version": 2, "token": "1" * 48, "role": "worker",
                              "host": "127.0.0.1", "rank": 0, "generation": 1}).encode())
    for _ in range(count):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
            try:
                with context.wrap_socket(raw) as s:
                    s.sendall(hello)
                    if s.recv(1) == b"":
                        refused.append(1)
            except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
                refused.append(1)


def many_bad_hellos(m, port):
    """MANY_BAD_HELLOS wrong-token hellos from BAD_HELLO_SENDERS threads, a
    valid notice in the middle; returns (seconds to the notice's ack, its
    result, refusals acknowledged, events.jsonl lines added)."""
    events_path = m.state_dir / "events.jsonl"
    lines_before = len(events_path.read_text().splitlines())
    refused = []
    senders = [threading.Thread(target=send_bad_hellos, args=(port, MANY_BAD_HELLOS // BAD_HELLO_SENDERS, refused))
               for _ in range(BAD_HELLO_SENDERS)]
    started = time.monotonic()
    for t in senders:
        t.start()
    wait_for("half of the bad hellos refused", lambda: len(refused) >= MANY_BAD_HELLOS // 2, 300)
    t0 = time.monotonic()
    result = m.notify_preempt(SPARE, "--in_seconds", "600", "--timeout_s", "10")
    ack_s = time.monotonic() - t0
    for t in senders:
        t.join()
    log("%d bad hellos refused in %.1f s; a notice in their middle acknowledged after %.3f s"
        % (len(refused), time.monotonic() - started, ack_s))
    return ack_s, result, len(refused), len(events_path.read_text().splitlines()) - lines_before


def test_control_plane_survives_a_connection_flood():
    # The attacker needs ~600 descriptors of its own.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = IDLE + SLOW + BAD_HELLOS + GARBAGE + 200
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard) if hard != resource.RLIM_INFINITY else want, hard))
    _port[0] += 10
    m = Manager(ROOT / "flood", THREE_HOSTS, stages=2, batch=8, chunk=4, steps=100000,
                job="starve-%d" % os.getpid(), prefix=["prlimit", "--nofile=%d:%d" % (FILE_LIMIT, FILE_LIMIT), "--"],
                extra_args=["--master_port", str(_port[0])])
    m.start()
    m.wait_step(5, timeout=90)
    pid = m.proc.pid
    limits = Path("/proc/%d/limits" % pid).read_text()
    assert any(line.startswith("Max open files") and " %d " % FILE_LIMIT in line for line in limits.splitlines()), limits
    wait_for("the spare host's agent (connection file)", lambda: m.connection_file(SPARE).exists(), 30)
    address = m.state()["address"]
    port = int(address.rsplit(":", 1)[1])
    assert address.startswith("127."), address

    events_path = m.state_dir / "events.jsonl"
    events_before = events_path.stat().st_size
    output_before = m.output_path.stat().st_size
    step_before = m.step()
    fds_before = open_fds(pid)
    cpu_before, wall_before = cpu_seconds(pid), time.monotonic()

    attack = Attack(port)
    try:
        attack.open()
        log("attack open: %d idle, %d slow-frame, %d wrong-token hello, %d malformed-frame sockets to port %d"
            % (IDLE, SLOW, BAD_HELLOS, GARBAGE, port))
        # Two notices: one at once (behind the flood in the listen queue), one
        # halfway through the hello deadline (every pending slot taken by idle
        # or trickling sockets).
        notices = []

        def notify(delay):
            time.sleep(delay)  # when to send, not synchronisation
            t0 = time.monotonic()
            result = m.notify_preempt(SPARE, "--in_seconds", "600", "--timeout_s", "10")
            notices.append((time.monotonic() - t0, result))

        notifiers = [threading.Thread(target=notify, args=(d,)) for d in (0.0, HELLO_DEADLINE_S / 2)]
        for t in notifiers:
            t.start()
        peak_fds = fds_before
        deadline = attack.opened_at + ATTACK_S
        while time.monotonic() < deadline or any(t.is_alive() for t in notifiers):
            if m.proc.poll() is not None:
                break
            peak_fds = max(peak_fds, open_fds(pid))
            time.sleep(0.1)  # sampling, not synchronisation
        for t in notifiers:
            t.join()
        for seconds, result in notices:
            log("notify_manager_preempt: exit %d after %.3f s: %s%s"
                % (result.returncode, seconds, result.stdout.strip(), result.stderr.strip()))
        cpu = (cpu_seconds(pid) - cpu_before) / (time.monotonic() - wall_before)
        closed_idle = attack.closed_by_peer(attack.idle)
        closed_slow = attack.closed_by_peer(attack.slow)
        closed_hellos = attack.closed_by_peer(attack.hellos)
        closed_garbage = attack.closed_by_peer(attack.garbage)
    finally:
        attack.close()
    alive = m.proc.poll() is None
    settled = False
    if alive:  # the manager lets go of the attack's connections (and has logged what it logs of them)
        try:
            settled = wait_for("descriptors", lambda: open_fds(pid) <= fds_before + 8, 10)
        except AssertionError:
            pass
    events_growth = events_path.stat().st_size - events_before
    output_growth = m.output_path.stat().st_size - output_before
    log("over %.1f s of attack: manager CPU %.1f%% of a core, descriptors %d -> peak %d (limit %d), event log +%d B, "
        "output +%d B; closed by the manager: %d/%d idle, %d/%d slow-frame, %d/%d hello, %d/%d malformed sockets"
        % (ATTACK_S, 100 * cpu, fds_before, peak_fds, FILE_LIMIT, events_growth, output_growth,
           closed_idle, IDLE, closed_slow, SLOW, closed_hellos, BAD_HELLOS, closed_garbage, GARBAGE))
    assert alive, "run_varuna died:\n" + m.tail()
    for seconds, result in notices:
        assert result.returncode == 0, result.stderr
        assert seconds < MAX_ACK_S, "a notice took %.2f s to be acknowledged" % seconds
    assert cpu < MAX_CPU, "manager CPU %.1f%% of a core during the attack" % (100 * cpu)
    assert events_growth < MAX_EVENT_GROWTH, "event log grew by %d bytes" % events_growth
    assert output_growth < MAX_OUTPUT_GROWTH, "manager output grew by %d bytes" % output_growth
    assert closed_idle == IDLE, "%d of %d idle sockets still open after %.0f s" % (IDLE - closed_idle, IDLE, ATTACK_S)
    assert (closed_slow, closed_hellos, closed_garbage) == (SLOW, BAD_HELLOS, GARBAGE), \
        (closed_slow, closed_hellos, closed_garbage)
    assert settled, "the manager still holds %d descriptors (%d before the attack)" % (open_fds(pid), fds_before)
    recorded = m.events("preempt_notice")
    assert len(recorded) == 2 and all(e["host"] == SPARE for e in recorded), recorded

    ack_s, result, refused, event_lines = many_bad_hellos(m, port)
    assert m.proc.poll() is None, "run_varuna died:\n" + m.tail()
    assert result.returncode == 0, result.stderr
    assert ack_s < MAX_ACK_S, "a notice among the bad hellos took %.2f s to be acknowledged" % ack_s
    assert refused == MANY_BAD_HELLOS, "%d of %d handshakes without a credential failed" % (refused, MANY_BAD_HELLOS)
    log("events.jsonl: +%d lines for %d bad hellos: %s" % (event_lines, MANY_BAD_HELLOS,
                                                         m.events("connections_dropped")[-1:]))
    assert event_lines <= MAX_EVENT_LINES_FOR_MANY, "events.jsonl grew by %d lines" % event_lines
    # Counted all the same: state.json's running totals (the event summary comes once a minute).
    wait_for("state.json's count of failed handshakes",
             lambda: m.state()["connections"]["unauthenticated"] >= MANY_BAD_HELLOS, 30)

    # The job trained through it and goes on.
    step_after = m.step()
    log("steps: %d before the attack, %d after" % (step_before, step_after))
    assert step_after > step_before, (step_before, step_after)
    m.wait_step(step_after + 5, timeout=30)
    assert len(m.events("launch")) == 1, "the job relaunched: %s" % m.events("launch")
    m.kill(signal.SIGTERM)
    assert m.wait_exit(120) == 0, m.tail()
    assert_nothing_left(m.job)


if __name__ == "__main__":
    run_tests([test_control_plane_survives_a_connection_flood])
