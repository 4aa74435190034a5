#!/usr/bin/env python3
"""run_varuna with no machine list: hosts join by themselves, as the tasks of a
Slurm job array or the pods of a Kubernetes StatefulSet do. The test plays the
scheduler: it starts `varuna_agent --join` in the foreground for each "host"
(127.0.0.1 and 127.0.0.2), sends the SIGTERM a scheduler sends when it
preempts a task, and starts the task again as a requeue does. Real manager,
agents and workers (the example trainer); no SSH. The Slurm cluster of P16
(slurmctld/slurmd in network namespaces) is not here yet: see
docs/deployment.md."""
import hashlib
import hmac
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from varuna_e2e import (  # noqa: E402
    BIN, assert_losses_continue, managers, assert_nothing_left, log, run_tests, wait_for)

ROOT = Path(os.environ.get("VARUNA_TEST_TMPDIR", tempfile.mkdtemp(prefix="varuna-join-")))
shutil.rmtree(ROOT, ignore_errors=True)
ROOT.mkdir(parents=True)


# Master ports from 20000 up, below the ephemeral range (32768-).
manager = managers(ROOT, 20000 + (os.getpid() % 150) * 40, "join")


class Task:
    """One scheduler task: `varuna_agent --join` in the foreground, as srun or
    a pod runs it (the scheduler tracks the process; it must not detach)."""

    def __init__(self, m, host, token_file=None, extra=(), run_dir=None):
        self.host = host
        self.log_path = m.workdir / ("task-%s-%d.log" % (host, time.monotonic_ns()))
        argv = [str(BIN / "varuna_agent"), "--join", m.address(), "--join_token_file",
                str(token_file or m.state_dir / "join_token"), "--job", m.job, "--host", host, "--slots", "2",
                *(["--run_dir", str(run_dir)] if run_dir else []), *extra]
        self.out = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self.out, stderr=subprocess.STDOUT)

    def wait(self, timeout=60):
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.out.close()

    def output(self):
        return self.log_path.read_text(errors="replace")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def join_credential(secret, expires_unix_s):
    """credentials.h's J(E), computed here from the job's secret."""
    expiry = str(expires_unix_s)
    mac = hmac.new(secret.encode(), ("join\n" + expiry).encode(), hashlib.sha256).hexdigest()
    return "vj1.%s.%s" % (expiry, mac)


def private_file(path, text):
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def test_hosts_join_grow_leave_on_sigterm_rejoin_and_the_losses_continue():
    grace = 60
    m = manager("grow-leave-rejoin", steps=100000, extra_args=["--min_hosts", "1"],
                train_args=["--checkpoint_every", "1000"]).start()
    wait_for("the join credential", lambda: (m.state_dir / "join_token").exists(), 30)
    assert (m.state_dir / "join_token").stat().st_mode & 0o077 == 0, "join_token must be private"
    tasks = [Task(m, "127.0.0.1", extra=["--sigterm_notice_s", str(grace)])]
    try:
        m.wait_event("launch", count=1, timeout=60)
        assert m.events("launch")[0]["plan"]["hosts"] == ["127.0.0.1"], m.events("launch")
        m.wait_step(20)

        # The second task starts: the job grows onto it (a checkpoint, no step lost).
        tasks.append(Task(m, "127.0.0.2", extra=["--sigterm_notice_s", str(grace)]))
        m.wait_event("launch", count=2, timeout=60)
        grown = m.events("launch")[1]
        assert grown["plan"]["hosts"] == ["127.0.0.1", "127.0.0.2"] and grown["recovery"] == "checkpoint", grown
        m.wait_step(grown["resume_step"] + 20)

        # Joins that must be refused, the job untouched: a second agent for
        # 127.0.0.2 (its own run folder, as on another machine), an expired
        # credential of this job, and another job's.
        dup = Task(m, "127.0.0.2", run_dir=m.workdir / "dup-run", extra=["--join_wait_s", "3"])
        assert dup.wait() == 1 and "present already" in dup.output(), dup.output()
        secret = (m.state_dir / "token").read_text().strip()
        expired = private_file(m.workdir / "expired", join_credential(secret, int(time.time()) - 60))
        other = private_file(m.workdir / "other", join_credential("another job", int(time.time()) + 3600))
        for path, why in ((expired, "expired join credential"), (other, "wrong join credential")):
            t = Task(m, "127.0.0.3", token_file=path)
            assert t.wait() == 2 and why in t.output(), t.output()
        readable = private_file(m.workdir / "readable", join_credential(secret, int(time.time()) + 3600))
        readable.chmod(0o644)
        t = Task(m, "127.0.0.3", token_file=readable)
        assert t.wait() == 2 and "chmod 600" in t.output(), t.output()
        assert len(m.events("launch")) == 2 and not m.events("kill_all"), m.events("launch")
        assert not m.events("host_joined")[2:], m.events("host_joined")

        # The scheduler preempts 127.0.0.2's task: SIGTERM, the grace to
        # follow. The job morphs onto 127.0.0.1 with no step lost; the task
        # ends long before the grace is out.
        first_join_notifier = m.connection_file("127.0.0.2").read_text()  # what a poller on the host holds
        sent = time.monotonic()
        tasks[1].proc.send_signal(signal.SIGTERM)
        m.wait_event("preempt_notice", timeout=30)
        m.wait_event("launch", count=3, timeout=60)
        shrunk = m.events("launch")[2]
        assert shrunk["plan"]["hosts"] == ["127.0.0.1"], shrunk
        assert shrunk["recovery"] == "checkpoint" and shrunk.get("steps_lost", 0) == 0, shrunk
        assert tasks[1].wait(timeout=grace / 2) == 0, tasks[1].output()
        log("SIGTERM -> morph done, task gone: %.2f s (grace %d s)" % (time.monotonic() - sent, grace))

        # Requeued: the task starts again under the same name and the job
        # grows back. Its credential comes from `run_varuna join-token`, as a
        # scheduler's secret store would hold it.
        issued = m.workdir / "issued_join_token"
        r = subprocess.run([str(BIN / "run_varuna"), "join-token", "--state_dir", str(m.state_dir), "--ttl_h", "1",
                            "--out", str(issued)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and issued.stat().st_mode & 0o077 == 0, r.stderr
        tasks.append(Task(m, "127.0.0.2", token_file=issued, extra=["--sigterm_notice_s", str(grace)]))
        m.wait_event("launch", count=4, timeout=60)
        # The first join's notifier certificate died with that join: refused
        # in the handshake, the job untouched.
        stale = private_file(m.workdir / "first-join-connection.json", first_join_notifier)
        r = subprocess.run([str(BIN / "notify_manager_preempt"), "--connection_file", str(stale)],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and "refused this certificate" in r.stderr, (r.returncode, r.stderr)
        assert len(m.events("preempt_notice")) == 1, m.events("preempt_notice")
        assert m.stop_once_trained_on(launches=4) == 0, m.tail()
        hosts = [e["plan"]["hosts"] for e in m.events("launch")]
        assert hosts == [["127.0.0.1"], ["127.0.0.1", "127.0.0.2"], ["127.0.0.1"], ["127.0.0.1", "127.0.0.2"]], hosts
        for t in (tasks[0], tasks[2]):
            assert t.wait() == 0, t.output()  # the job ended: every task ends with it, cleanly
    finally:
        for t in tasks:
            t.kill()
    assert_nothing_left(m.job)

    # Through two grows and a preemption the job trained what an
    # uninterrupted run on one host trains.
    got = m.losses()
    steps = max(got) + 1
    ref = manager("grow-leave-rejoin-reference", machines=["127.0.0.1 slots=2"], steps=steps).start()
    assert ref.wait_exit() == 0, ref.tail()
    assert_losses_continue(got, ref.losses(), steps)


def test_a_host_joins_beside_the_machine_list_with_the_jobs_timing_and_leaves():
    """Joins next to a machine list (the default --machine_source list): the
    listed host trains from the start, a joined host grows the job and leaves
    it on its scheduler's SIGTERM, and the listed host's name cannot be
    joined. A joined agent takes the job's timing (--agent_grace_s, and the
    lost-manager time run_varuna gives the agents it starts: heartbeat timeout
    plus grace) unless its own flags set it."""
    m = manager("beside-list", machines=["127.0.0.1 slots=2"], steps=100000, extra_args=["--agent_grace_s", "4"],
                train_args=["--checkpoint_every", "1000"]).start()
    tasks = []
    try:
        m.wait_event("launch", count=1, timeout=60)
        assert m.events("launch")[0]["plan"]["hosts"] == ["127.0.0.1"], m.events("launch")
        m.wait_step(10)
        wait_for("the join credential", lambda: (m.state_dir / "join_token").exists(), 30)

        # The listed host's name is run_varuna's to start: a join under it is refused for good.
        listed = Task(m, "127.0.0.1", run_dir=m.workdir / "listed-run")
        assert listed.wait() == 2 and "the host is in the machine list" in listed.output(), listed.output()

        tasks.append(Task(m, "127.0.0.2", extra=["--sigterm_notice_s", "60"]))
        m.wait_event("launch", count=2, timeout=60)
        grown = m.events("launch")[1]
        assert grown["plan"]["hosts"] == ["127.0.0.1", "127.0.0.2"] and grown["recovery"] == "checkpoint", grown
        wait_for("state.json marks 127.0.0.2 joined, 127.0.0.1 not (%s)" % m.state().get("hosts"),
                 lambda: m.state().get("hosts", {}).get("127.0.0.2", {}).get("joined") is True
                 and "joined" not in m.state().get("hosts", {}).get("127.0.0.1", {}), 30)
        # heartbeat_timeout_s 10 (the default) + agent_grace_s 4; relays every twentieth of the 10 s.
        assert "grace 4000 ms (the job's), manager lost after 14000 ms without a word (the job's), " \
            "heartbeats relayed every 500 ms" in tasks[0].output(), tasks[0].output()
        m.wait_step(grown["resume_step"] + 10)

        tasks[0].proc.send_signal(signal.SIGTERM)
        m.wait_event("launch", count=3, timeout=60)
        shrunk = m.events("launch")[2]
        assert shrunk["plan"]["hosts"] == ["127.0.0.1"], shrunk
        assert shrunk["recovery"] == "checkpoint" and shrunk.get("steps_lost", 0) == 0, shrunk
        assert tasks[0].wait(timeout=30) == 0, tasks[0].output()
        assert m.stop_once_trained_on(launches=3) == 0, m.tail()
    finally:
        for t in tasks:
            t.kill()
    assert_nothing_left(m.job)


def free_port():
    """A port nothing listens on now: a restarted manager must come back where
    its joined agents look for it, so this test cannot use --port 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_joined_hosts_rejoin_a_restarted_manager_and_the_job_carries_on():
    """The manager's job is requeued (or the head node reboots): the joined
    agents lose it, stop their workers after their grace, and join again as
    soon as it listens again; it resumes from the last checkpoint."""
    m = manager("restart", steps=100000, extra_args=["--port", str(free_port()), "--min_hosts", "2"],
                train_args=["--checkpoint_every", "20"]).start()
    tasks = [Task(m, host, extra=["--grace_s", "1"]) for host in ("127.0.0.1", "127.0.0.2")]
    try:
        m.wait_event("launch", count=1, timeout=60)
        for t in tasks:  # its own grace, the job's lost-manager time (10 s + the default grace of 5 s)
            assert "grace 1000 ms (set here), manager lost after 15000 ms without a word (the job's)" in t.output(), \
                t.output()
        m.wait_step(45)
        m.kill(signal.SIGKILL)
        m.proc.wait()
        m.start()  # the same state folder and port
        m.wait_event("host_joined", count=4, timeout=90)
        assert m.stop_once_trained_on(launches=2) == 0, m.tail()
        launches = m.events("launch")
        assert [e["plan"]["hosts"] for e in launches] == [["127.0.0.1", "127.0.0.2"]] * 2, launches
        assert launches[1]["resume_step"] >= 40 and launches[1]["generation"] > launches[0]["generation"], launches
        for t in tasks:
            assert t.wait() == 0, t.output()
            assert "joining again" in t.output(), t.output()
    finally:
        for t in tasks:
            t.kill()
    assert_nothing_left(m.job)


if __name__ == "__main__":
    run_tests([test_hosts_join_grow_leave_on_sigterm_rejoin_and_the_losses_continue,
               test_a_host_joins_beside_the_machine_list_with_the_jobs_timing_and_leaves,
               test_joined_hosts_rejoin_a_restarted_manager_and_the_job_carries_on])
