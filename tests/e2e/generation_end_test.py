#!/usr/bin/env python3
"""A generation ends everywhere, whatever its agents' state (docs/run_varuna.md,
"How long a superseded process can live"). Two loopback "hosts" (127.0.0.1 and
127.0.0.2, two slots each), the example trainer, real agents and workers.

- The agent of 127.0.0.2 is frozen (SIGSTOP: what an agent that is swapping,
  wedged or being OOM-killed looks like), then a worker on 127.0.0.1 is
  killed: the manager kills the generation. The frozen agent cannot kill its
  workers, yet they are gone within the bound (run_varuna orders them out over
  their own connections), no file of the old generation is written into the
  store after the next launch, and the job finishes on 127.0.0.1.
- run_varuna is killed and restarted on the same port while every agent is
  frozen: the old workers reconnect to the new manager, which orders them out
  (`stale_worker` events) before anything else could stop them.
In both, nothing is left at the end.
"""
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from varuna_e2e import (StoreWatcher, managers, assert_nothing_left, log, processes_of_job, run_tests,  # noqa: E402
                        wait_for)

ROOT = Path(os.environ.get("VARUNA_TEST_TMPDIR", tempfile.mkdtemp(prefix="varuna-generation-end-")))
shutil.rmtree(ROOT, ignore_errors=True)
ROOT.mkdir(parents=True)
TWO_HOSTS = ["127.0.0.1 slots=2", "127.0.0.2 slots=2"]

# How long a worker ordered out over its connection may take to be gone
# (docs/run_varuna.md says: at once, within its link's 0.1 s read interval);
# generous for a loaded 2-core machine.
ORDERED_EXIT_BOUND_S = 3.0


# Master ports from 26000 up, below the ephemeral range (32768-).
manager = managers(ROOT, 26000 + (os.getpid() % 150) * 40, "e2e", TWO_HOSTS)


def host_of(pid):
    try:
        environ = Path("/proc/%d/environ" % pid).read_bytes()
    except OSError:
        return None
    for item in environ.split(b"\0"):
        if item.startswith(b"VARUNA_HOST="):
            return item.split(b"=", 1)[1].decode()
    return None


def agents_and_workers(job):
    """{host: (agent pid, [worker pids])} of the job's live processes."""
    out = {}
    for pid, cmd in processes_of_job(job):
        if "varuna_agent" in cmd:
            host = cmd.split("--host ", 1)[1].split(" ", 1)[0]
            out.setdefault(host, [None, []])[0] = pid
        elif "train_gpt" in cmd:
            out.setdefault(host_of(pid), [None, []])[1].append(pid)
    return out


def running(pid):
    """Alive and not a zombie (a frozen agent cannot reap its exited workers)."""
    try:
        stat = Path("/proc/%d/stat" % pid).read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def test_frozen_agent_workers_are_gone_within_the_bound():
    m = manager("frozen-agent", steps=240,
                # --host_retry_s 0: the frozen host is not started again (a new
                # agent would stop the frozen one; this test watches it thaw).
                extra_args=["--heartbeat_timeout_s", "3", "--restart_backoff_s", "0.2", "--agent_grace_s", "2",
                            "--host_retry_s", "0", "--no_salvage"],  # salvage: salvage_test.py
                train_args=["--checkpoint_every", "10"]).start()
    watcher = StoreWatcher(m.store, 1)
    watcher.start()
    m.wait_step(25)
    procs = agents_and_workers(m.job)
    frozen_agent, frozen_workers = procs["127.0.0.2"]
    victim = procs["127.0.0.1"][1][0]
    assert frozen_agent and len(frozen_workers) == 2, procs
    os.kill(frozen_agent, signal.SIGSTOP)
    try:
        os.kill(victim, signal.SIGKILL)
        m.wait_event("kill_all", timeout=15)
        killed_at = m.events("kill_all")[0]["unix_ms"] / 1000
        wait_for("the frozen agent's workers gone", lambda: not any(running(p) for p in frozen_workers),
                 ORDERED_EXIT_BOUND_S + 10)
        gone_after = time.time() - killed_at
        log("kill-all -> the frozen agent's workers gone: %.2f s (bound %.1f s)" % (gone_after, ORDERED_EXIT_BOUND_S))
        assert gone_after <= ORDERED_EXIT_BOUND_S, gone_after
        assert running(frozen_agent)  # still there, frozen
        m.wait_event("launch", count=2, timeout=60)
        second = m.events("launch")[1]
        assert second["plan"]["hosts"] == ["127.0.0.1"], second
        assert m.events("host_lost")[0]["host"] == "127.0.0.2"
        assert m.wait_exit() == 0, m.tail()
    finally:
        os.kill(frozen_agent, signal.SIGCONT)
    watcher.assert_none_after(second)
    # The thawed agent reaps its workers, finds the manager gone and exits
    # after its grace. The workers left either on the manager's order (code
    # 76) or, when their collective with the killed rank failed first, as
    # peers lost (code 3): both within the bound, which is what counts.
    assert_nothing_left(m.job)
    agent_log = (Path("/tmp/varuna") / m.job / "127.0.0.2" / "agent.log").read_text(errors="replace")
    exits = re.findall(r"\(generation 1\) exited: code (\d+)", agent_log)
    assert len(exits) == 2 and set(exits) <= {"76", "3"}, agent_log[-2000:]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_restarted_manager_orders_leftover_workers_out():
    m = manager("restart-frozen", steps=100000, extra_args=["--agent_grace_s", "30"])
    m.argv[m.argv.index("--port") + 1] = str(free_port())  # a systemd unit fixes it: the workers find the new manager
    m.start()
    m.wait_step(10)
    procs = agents_and_workers(m.job)
    old_agents = [a for a, _ in procs.values()]
    old_workers = [w for _, ws in procs.values() for w in ws]
    assert len(old_agents) == 2 and len(old_workers) == 4, procs
    # Every agent frozen: nothing but run_varuna itself can stop the workers
    # (the new agents would SIGKILL frozen ones only after 5 s).
    for pid in old_agents:
        os.kill(pid, signal.SIGSTOP)
    try:
        m.kill(signal.SIGKILL)
        m.proc.wait()
        assert all(running(p) for p in old_workers), "the workers train on without a manager for a while"
        restarted_at = time.time()
        m.start()
        wait_for("the old workers gone", lambda: not any(running(p) for p in old_workers), 15)
        gone_after = time.time() - restarted_at
        log("manager restarted -> the old generation's workers gone: %.2f s" % gone_after)
        stale = m.events("stale_worker")
        # Each old worker is ordered out when it reconnects; one whose peers
        # were ordered out first may instead leave as a peer lost before it
        # reconnects. Either way every one is gone, and only generation 1.
        assert stale and {e["rank"] for e in stale} <= {0, 1, 2, 3} and {e["generation"] for e in stale} == {1}, stale
        # The new agents SIGKILL the frozen ones (their workers die with them)
        # only 5 s after they start: gone before that, they were ordered out.
        assert gone_after < 5.0, gone_after
    finally:
        for pid in old_agents:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    m.wait_event("launch", count=2, timeout=60)
    assert m.events("launch")[-1]["generation"] == 2
    m.wait_step(max(m.step(), 0) + 5)
    m.kill(signal.SIGTERM)
    assert m.wait_exit() == 0, m.tail()
    assert_nothing_left(m.job)


if __name__ == "__main__":
    run_tests([
        test_frozen_agent_workers_are_gone_within_the_bound,
        test_restarted_manager_orders_leftover_workers_out,
    ])
