#!/usr/bin/env python3
"""run_varuna over SSH: hosts are network namespaces, each with its own real
sshd and throwaway keys (netns_cluster.py); the manager runs in a separate
"head" namespace and starts the agents with libssh, checking host keys.

Scenarios: a preemption notice sent from the preempted host itself, then a
host added to the machine list; a host vanishing (kill -9 of everything on it,
network down: the survivors salvage the step reached, docs/salvage.md) and a host made slow with a CPU quota; and the set-up errors a
user meets first (unknown host key, wrong key, unreachable host, missing
program). Every scenario ends with no process left on any host."""
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns_cluster import Cluster  # noqa: E402
from varuna_e2e import (  # noqa: E402
    BIN, Manager, assert_losses_continue, assert_nothing_left, log,
    processes_of_job, run_tests, wait_for)

if os.geteuid() != 0:
    print("skipped: network namespaces and sshd need root")
    sys.exit(77)

ROOT = Path(os.environ.get("VARUNA_TEST_TMPDIR", tempfile.mkdtemp(prefix="varuna-ssh-e2e-")))
shutil.rmtree(ROOT, ignore_errors=True)  # nothing of an earlier run (state, checkpoints) may leak into this one
ROOT.mkdir(parents=True, exist_ok=True)


def ssh_manager(cluster, name, hosts, identity=None, known_hosts=None, **kw):
    extra = ["--manager_ip", cluster.head_addr, "--ssh_identity", identity or cluster.identity_file,
             "--ssh_known_hosts", known_hosts or cluster.known_hosts_file, "--ssh_connect_timeout_s", "3",
             "--heartbeat_timeout_s", "3", "--restart_backoff_s", "0.2", *kw.pop("extra_args", [])]
    return Manager(ROOT / name, hosts, job="ssh-" + name + "-" + str(os.getpid()), extra_args=extra,
                   prefix=["ip", "netns", "exec", cluster.head_ns], **kw)


def hosts_of(plan_event):
    return plan_event["plan"]["hosts"]


def assert_clean(cluster, m):
    assert_nothing_left(m.job)
    left = cluster.leftover_processes()
    assert not left, "processes left on the hosts: %s" % left


def test_preemption_from_the_host_then_a_host_added():
    with Cluster(3, str(ROOT / "cluster-preempt")) as c:
        h0, h1, h2 = c.hosts
        m = ssh_manager(c, "preempt", ["%s slots=2" % h0.addr, "%s slots=2" % h1.addr], steps=400)
        m.start()
        m.wait_step(30)
        # The poller on the preempted VM calls the hook with the agent's connection file.
        r = c.run_in(h1, [str(BIN / "notify_manager_preempt"), "--connection_file", str(m.connection_file(h1.addr)),
                          "--in_seconds", "30"])
        assert r.returncode == 0, r.stderr
        m.wait_event("launch", count=2, timeout=60)
        assert hosts_of(m.events("launch")[1]) == [h0.addr]
        m.wait_event("morph_complete", timeout=60)
        # The operator drops the preempted VM and adds another (a list that
        # still named h1 would bring it back: written, it is there).
        m.write_machines(["%s slots=2" % h.addr for h in (h0, h2)])
        m.wait_event("launch", count=3, timeout=60)
        assert m.wait_exit(240) == 0, m.tail()
        plans = [((e["plan"]["stages"], e["plan"]["replicas"]), hosts_of(e)) for e in m.events("launch")]
        assert plans == [((2, 2), [h0.addr, h1.addr]), ((2, 1), [h0.addr]), ((2, 2), [h0.addr, h2.addr])], plans
        assert len(m.events("morph_complete")) == 2
        assert_clean(c, m)
    # Exact resume across both morphs: the losses are those of an uninterrupted
    # run (same global batches; here one 2x1 run on this machine).
    ref = Manager(ROOT / "preempt-reference", ["127.0.0.1 slots=2"], job="ssh-reference-" + str(os.getpid()),
                  steps=400).start()
    assert ref.wait_exit() == 0, ref.tail()
    assert_losses_continue(m.losses(), ref.losses(), 400)


def worker_pids_on(job, host):
    """train_gpt processes of `job` on `host` (hosts are network namespaces; the PIDs are this machine's)."""
    out = []
    for pid, cmd in processes_of_job(job):
        try:
            if "train_gpt" in cmd and ("VARUNA_HOST=%s\0" % host).encode() in Path("/proc/%d/environ" % pid).read_bytes():
                out.append(pid)
        except OSError:
            pass
    return out


def test_hung_worker_then_the_manager_killed_and_restarted():
    with Cluster(2, str(ROOT / "cluster-hung")) as c:
        h0, h1 = c.hosts
        m = ssh_manager(c, "hung", ["%s slots=2" % h.addr for h in (h0, h1)], steps=300,
                        train_args=["--checkpoint_every", "20"], extra_args=["--agent_grace_s", "30"])
        m.start()
        m.wait_step(25)
        # A worker on h1 stops answering (SIGSTOP): only its heartbeats tell.
        victim = worker_pids_on(m.job, h1.addr)
        assert len(victim) == 2, processes_of_job(m.job)
        t0 = time.monotonic()
        os.kill(victim[0], signal.SIGSTOP)
        m.wait_event("worker_hung", timeout=30)
        log("SIGSTOP -> worker_hung after %.1f s (heartbeat timeout 3 s)" % (time.monotonic() - t0))
        m.wait_event("launch", count=2, timeout=60)
        assert m.events("launch")[1]["resume_step"] >= 20, m.events("launch")
        wait_for("the stopped worker killed", lambda: victim[0] not in worker_pids_on(m.job, h1.addr), 30)
        m.wait_event("morph_complete", timeout=60)
        resumed = m.events("launch")[1]["resume_step"]
        m.wait_step(resumed + 25)
        # The manager dies (kill -9) mid-run; systemd would start it again with
        # the same command and state folder.
        m.kill(signal.SIGKILL)
        m.proc.wait()
        assert processes_of_job(m.job), "agents and workers keep running within the grace period"
        m.start()
        assert m.wait_exit(240) == 0, m.tail()
        assert m.events("manager_restarted"), "the restart was not recognised"
        last = m.events("launch")[-1]
        assert last["generation"] == 3 and last["resume_step"] >= resumed + 20, m.events("launch")
        assert sorted(m.losses()) == list(range(300))
        assert_clean(c, m)


def test_host_vanishes_then_a_slow_host_is_flagged():
    with Cluster(3, str(ROOT / "cluster-vanish")) as c:
        h0, h1, h2 = c.hosts
        m = ssh_manager(c, "vanish", ["%s slots=2" % h.addr for h in (h0, h1, h2)], steps=100000,
                        extra_args=["--slow_window", "5"], train_args=["--checkpoint_every", "10"])
        m.start()
        m.wait_step(25)
        assert hosts_of(m.events("launch")[0]) == [h0.addr, h1.addr]  # h2 is spare (16 % 3 != 0)
        t0 = time.monotonic()
        c.kill_host(h1)
        m.wait_event("launch", count=2, timeout=60)
        log("host vanished -> relaunch decided in %.1f s" % (time.monotonic() - t0))
        second = m.events("launch")[1]
        assert hosts_of(second) == [h0.addr, h2.addr] and second["resume_step"] >= 25, second
        # h0's replica survived: it wrote the step the job had reached (salvage.md).
        assert second["recovery"] == "salvage" and second["steps_lost"] == 0, (second, m.events("salvage_abandoned"))
        m.wait_event("morph_complete", timeout=60)
        c.slow_host(h2, 0.15)
        slow_file = m.state_dir / "slow_machines.out"
        wait_for("slow_machines.out naming %s" % h2.addr,
                 lambda: slow_file.exists() and h2.addr in slow_file.read_text(), timeout=120)
        log("slow_machines.out:\n" + slow_file.read_text())
        assert h0.addr not in slow_file.read_text()
        m.kill(signal.SIGTERM)
        assert m.wait_exit(120) == 0, m.tail()
        assert_clean(c, m)


def test_setup_errors_are_clear():
    with Cluster(2, str(ROOT / "cluster-errors")) as c:
        h0, h1 = c.hosts
        empty_known_hosts = ROOT / "empty_known_hosts"
        empty_known_hosts.write_text("")
        cases = [
            ("unknown-key", dict(known_hosts=str(empty_known_hosts)), ["ssh-keyscan", "known_hosts"]),
            ("wrong-key", dict(identity=c.wrong_identity_file), ["authenticat"]),
            ("missing-program", dict(program="./no_such_trainer"), ["no_such_trainer does not exist"]),
        ]
        for name, kw, expected in cases:
            m = ssh_manager(c, name, ["%s slots=2" % h0.addr], **kw)
            m.start()
            code = m.wait_exit(60)
            out = m.output()
            log(name, "-> exit", code, ":", [l for l in out.splitlines() if "error" in l][:2])
            assert code == 2, (name, code, m.tail())
            for text in expected:
                assert text in out, (name, text, m.tail())
            assert_clean(c, m)
        # An unreachable machine: reported, and the job runs on the others.
        m = ssh_manager(c, "unreachable", ["10.213.0.99 slots=2", "%s slots=2" % h1.addr], steps=30)
        m.start()
        assert m.wait_exit(120) == 0, m.tail()
        failed = m.events("agent_failed")
        assert failed and failed[0]["host"] == "10.213.0.99", failed
        log("unreachable:", failed[0]["reason"])
        assert "10.213.0.99" in failed[0]["reason"]
        assert hosts_of(m.events("launch")[0]) == [h1.addr]
        assert_clean(c, m)


if __name__ == "__main__":
    run_tests([
        test_setup_errors_are_clear,
        test_preemption_from_the_host_then_a_host_added,
        test_host_vanishes_then_a_slow_host_is_flagged,
        test_hung_worker_then_the_manager_killed_and_restarted,
    ])
