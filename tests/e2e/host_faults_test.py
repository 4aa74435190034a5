#!/usr/bin/env python3
"""Host faults over SSH: hosts are network namespaces each running a real sshd
(netns_cluster.py), run_varuna runs in a separate head namespace and starts
the agents with libssh. Heartbeat timeout 3 s, agent grace 2 s, so a
superseded process lives at most 7 s (docs/run_varuna.md).

- An agent frozen (SIGSTOP): its workers are ordered out within the bound of
  the kill-all, and the old generation writes nothing into the store after the
  next launch.
- A host killed (the VM gone: link down, every process SIGKILLed) then booted
  again with the same address: the manager retries it with backoff and it
  rejoins (`host_back`) without the machine list being touched; the job grows
  back onto it.
- A link cut for 30 s: the job goes on on the other hosts, the partitioned
  host's agent and workers end themselves within the bound, and after the
  link heals the host rejoins.
- A host preempted with a deadline far away comes back at once when the
  machine list is written again, even with the same text.
- A worker spinning outside c10d (train_gpt's busy-loop hook) while its peers
  wait: `--hang_timeout_s` names it hung and the job recovers.
Every case ends with no process left on any host.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_faults_common import (  # noqa: E402
    AGENT_GRACE_S, HEARTBEAT_TIMEOUT_S, ORDERED_EXIT_BOUND_S, SLACK_S, SUPERSEDED_BOUND_S,
    hosts_of, job_processes_on, launches_since, notify_preempt_from, running, set_link, ssh_manager,
    stop_and_check_clean, wait_generation_steps)
from netns_cluster import Cluster  # noqa: E402
from varuna_e2e import TRAIN_DIR, StoreWatcher, log, run_tests, wait_for  # noqa: E402

if os.geteuid() != 0:
    print("skipped: network namespaces and sshd need root")
    sys.exit(77)

ROOT = Path(os.environ.get("VARUNA_TEST_TMPDIR", tempfile.mkdtemp(prefix="varuna-host-faults-")))
shutil.rmtree(ROOT, ignore_errors=True)  # nothing of an earlier run may leak into this one
ROOT.mkdir(parents=True, exist_ok=True)

# How long a lost host may take to come back once it can: the retry backoff
# (2 s doubling, at most 60 s) may have just grown to its next step, plus an
# SSH attempt that times out (3 s) and the agent's start.
REJOIN_TIMEOUT_S = 90


def manager(cluster, name, hosts, **kw):
    return ssh_manager(cluster, ROOT, "hf-" + name, ["%s slots=2" % h.addr for h in hosts], **kw)


def host_back_events(m, host):
    return [e for e in m.events("host_back") if e.get("host") == host.addr]


def start_job(cluster, name, first_steps):
    """The job on every host of `cluster` (a checkpoint every 10 steps), once
    it has trained `first_steps` steps."""
    m = manager(cluster, name, cluster.hosts, steps=100000, train_args=["--checkpoint_every", "10"])
    m.start()
    m.wait_step(first_steps)
    return m


def test_frozen_agent_workers_gone_and_store_untouched():
    with Cluster(3, str(ROOT / "cluster-frozen")) as c:
        h0, h1, h2 = c.hosts
        # --no_salvage: this is about the kill-all reaching a frozen agent's workers.
        m = manager(c, "frozen", c.hosts, steps=100000, train_args=["--checkpoint_every", "10"],
                    extra_args=["--no_salvage"])
        m.start()
        watcher = StoreWatcher(m.store, 1)
        watcher.start()
        m.wait_step(25)
        assert hosts_of(m.events("launch")[0]) == [h0.addr, h1.addr], m.events("launch")  # h2 spare (16 % 3)
        procs = job_processes_on(c, h1, m.job)
        assert len(procs["agent"]) == 1 and len(procs["workers"]) == 2, procs
        frozen_workers = procs["workers"]
        frozen_at = time.time()
        assert c.stop_host_processes(h1, "varuna_agent") == procs["agent"]
        try:
            m.wait_event("kill_all", timeout=HEARTBEAT_TIMEOUT_S + 20)
            kill_all = m.events("kill_all")[0]
            noticed_after = kill_all["unix_ms"] / 1000 - frozen_at
            log("agent frozen -> kill_all after %.2f s (%s)" % (noticed_after, kill_all["reason"]))
            # Agents are timed out after max(--heartbeat_timeout_s, 3).
            assert noticed_after <= max(HEARTBEAT_TIMEOUT_S, 3) + SLACK_S, noticed_after
            assert m.events("host_lost")[0]["host"] == h1.addr, m.events("host_lost")
            wait_for("the frozen agent's workers gone", lambda: not any(running(p) for p in frozen_workers),
                     ORDERED_EXIT_BOUND_S + 20)
            gone_after = time.time() - kill_all["unix_ms"] / 1000
            log("kill_all -> the frozen agent's workers gone: %.2f s (bound %.1f s)" % (gone_after, ORDERED_EXIT_BOUND_S))
            assert gone_after <= ORDERED_EXIT_BOUND_S, gone_after
            m.wait_event("launch", count=2, timeout=60)
            second = m.events("launch")[1]
            assert hosts_of(second) == [h0.addr, h2.addr], second
            wait_generation_steps(m, second["generation"], 10, 90)
        finally:
            c.cont_host_processes(h1, "varuna_agent")
        watcher.assert_none_after(second)
        stop_and_check_clean(c, m)


def test_killed_host_rejoins_without_a_machine_list_change():
    with Cluster(2, str(ROOT / "cluster-reboot")) as c:
        h0, h1 = c.hosts
        m = start_job(c, "reboot", 25)
        assert hosts_of(m.events("launch")[0]) == [h0.addr, h1.addr]
        killed_at = time.time()
        c.kill_host(h1)
        m.wait_event("launch", count=2, timeout=60)
        second = m.events("launch")[1]
        assert hosts_of(second) == [h0.addr] and second["plan"]["replicas"] == 1, second
        log("host killed -> relaunch on %s after %.1f s" % (hosts_of(second), second["unix_ms"] / 1000 - killed_at))
        wait_generation_steps(m, second["generation"], 5, 90)
        # The VM stays down while the manager tries it twice (SSH times out
        # after 3 s each), then boots again: same address and host key, a
        # fresh sshd, no agent.
        failed = wait_for("two failed start-ups on %s (manager output:\n%s)" % (h1.addr, m.tail()),
                          lambda: len([e for e in m.events("agent_failed") if e["host"] == h1.addr]) >= 2
                          and [e for e in m.events("agent_failed") if e["host"] == h1.addr], 60)
        gaps = [round((b["unix_ms"] - a["unix_ms"]) / 1000, 1) for a, b in zip(failed, failed[1:])]
        log("retries of the lost host failed: %s; time between failures %s s" % (
            [e["reason"][:80] for e in failed], gaps))
        assert gaps[0] >= 4 - 0.5, "the second try came less than the doubled wait (4 s) after the first: %s" % gaps
        restarted_at = time.time()
        c.restart_host(h1)
        wait_for("host_back for %s (manager output:\n%s)" % (h1.addr, m.tail()),
                 lambda: host_back_events(m, h1) or m._died(), REJOIN_TIMEOUT_S)  # noqa: SLF001
        back = host_back_events(m, h1)[0]
        log("host restarted -> host_back after %.1f s: %s" % (back["unix_ms"] / 1000 - restarted_at, back))
        assert back["why"] == "lost" and back["attempts"] >= 3, back
        grown = wait_for("a launch on both hosts again", lambda: [e for e in launches_since(m, restarted_at)
                                                                  if hosts_of(e) == [h0.addr, h1.addr]], 90)[0]
        assert (grown["plan"]["stages"], grown["plan"]["replicas"]) == (2, 2), grown
        wait_generation_steps(m, grown["generation"], 5, 90)
        assert not m.events("machine_list_changed"), "the machine list was not touched"
        stop_and_check_clean(c, m)


def test_partitioned_host_ends_itself_and_rejoins_after_healing():
    with Cluster(3, str(ROOT / "cluster-partition")) as c:
        h0, h1, h2 = c.hosts
        m = start_job(c, "partition", 25)
        assert hosts_of(m.events("launch")[0]) == [h0.addr, h1.addr], m.events("launch")
        before = job_processes_on(c, h1, m.job)
        assert len(before["agent"]) == 1 and len(before["workers"]) == 2, before
        cut_at = time.time()
        set_link(c, h1, up=False)
        try:
            # The partitioned side: nothing reaches the manager, nothing comes
            # back; the agent (heartbeat + grace) and the workers (heartbeat +
            # grace + 2 s) end themselves.
            times = {}

            def all_gone():
                now = job_processes_on(c, h1, m.job)
                for kind in ("agent", "workers"):
                    if not now[kind] and kind not in times:
                        times[kind] = time.time() - cut_at
                return len(times) == 2
            try:
                wait_for("the partitioned host's agent and workers gone", all_gone, SUPERSEDED_BOUND_S + 30)
            except AssertionError as e:
                raise AssertionError("%s; left: %s" % (e, job_processes_on(c, h1, m.job))) from None
            log("link cut -> on the partitioned host the agent gone after %.1f s (bound %d s), the workers after "
                "%.1f s (bound %d s)" % (times["agent"], HEARTBEAT_TIMEOUT_S + AGENT_GRACE_S, times["workers"],
                                         SUPERSEDED_BOUND_S))
            assert times["agent"] <= HEARTBEAT_TIMEOUT_S + AGENT_GRACE_S + SLACK_S, times
            assert times["workers"] <= SUPERSEDED_BOUND_S + SLACK_S, times
            # The manager's side: the job goes on on the others.
            m.wait_event("launch", count=2, timeout=60)
            second = m.events("launch")[1]
            assert hosts_of(second) == [h0.addr, h2.addr], second
            assert m.events("host_lost")[0]["host"] == h1.addr
            wait_generation_steps(m, second["generation"], 10, 90)
            time.sleep(max(0.0, cut_at + 30 - time.time()))  # the fault itself: the partition lasts 30 s
        finally:
            set_link(c, h1, up=True)
        healed_at = time.time()
        log("link up after %.1f s" % (healed_at - cut_at))
        wait_for("host_back for %s (manager output:\n%s)" % (h1.addr, m.tail()),
                 lambda: host_back_events(m, h1) or m._died(), REJOIN_TIMEOUT_S)  # noqa: SLF001
        back = host_back_events(m, h1)[0]
        log("link healed -> host_back after %.1f s" % (back["unix_ms"] / 1000 - healed_at))
        wait_for("%s's agent up in state.json" % h1.addr,
                 lambda: m.state().get("hosts", {}).get(h1.addr, {}).get("agent") == "up", 30)
        after = job_processes_on(c, h1, m.job)
        assert len(after["agent"]) == 1 and not set(after["agent"]) & set(before["agent"]), (before, after)
        assert not set(after["workers"]) & set(before["workers"]), (before, after)
        stop_and_check_clean(c, m)


def test_preempted_host_readmitted_when_the_list_is_written_again():
    with Cluster(2, str(ROOT / "cluster-readmit")) as c:
        h0, h1 = c.hosts
        m = start_job(c, "readmit", 20)
        # A notice with a deadline far away: only the operator brings it back.
        r = notify_preempt_from(c, m, h1, "--in_seconds", "600")
        assert r.returncode == 0, r.stderr
        m.wait_event("launch", count=2, timeout=60)
        assert hosts_of(m.events("launch")[1]) == [h0.addr], m.events("launch")
        wait_generation_steps(m, m.events("launch")[1]["generation"], 5, 90)
        assert not host_back_events(m, h1)
        # The same text written again (a new file: another inode) says "the
        # hosts listed are there": the preemption's deadline no longer waits.
        written_at = time.time()
        m.write_machines(["%s slots=2" % h.addr for h in c.hosts])
        m.wait_event("hosts_readmitted", timeout=30)
        readmitted = m.events("hosts_readmitted")[0]
        assert [(x["host"], x["why"]) for x in readmitted["hosts"]] == [(h1.addr, "preempted")], readmitted
        wait_for("host_back for %s" % h1.addr, lambda: host_back_events(m, h1) or m._died(), 60)  # noqa: SLF001
        log("list written again -> %s back after %.1f s: %s" % (
            h1.addr, host_back_events(m, h1)[0]["unix_ms"] / 1000 - written_at, host_back_events(m, h1)[0]))
        grown = wait_for("a launch on both hosts again", lambda: [e for e in launches_since(m, written_at)
                                                                  if hosts_of(e) == [h0.addr, h1.addr]], 90)[0]
        wait_generation_steps(m, grown["generation"], 5, 90)
        stop_and_check_clean(c, m)


def busy_loop_options():
    """train_gpt's hook that spins one rank outside c10d before a step (its
    name from --help: the hook is example code, not a documented interface)."""
    text = subprocess.run([str(TRAIN_DIR / "train_gpt"), "--help"], capture_output=True, text=True,
                          timeout=60).stdout
    names = [w for w in text.split() if w.startswith("--") and "busy" in w]
    step = next((n for n in names if "step" in n), None)
    rank = next((n for n in names if "rank" in n), None)
    assert step and rank, "train_gpt has no busy-loop hook yet (options with 'busy' in --help: %s)" % names
    return step, rank


def first_generation_only(path, hook_args):
    """A wrapper that gives train_gpt the hook in generation 1 only. The hook
    fires in every generation that reaches its step (the relaunch resumes from
    a checkpoint before it), so without this the job would hang again after
    every recovery until --max_failures stops it."""
    train_gpt = TRAIN_DIR / "train_gpt"
    path.write_text("#!/bin/sh\n"
                    'if [ "$VARUNA_GENERATION" = 1 ]; then exec %s "$@" %s; fi\n'
                    'exec %s "$@"\n' % (train_gpt, " ".join(hook_args), train_gpt))
    path.chmod(0o755)
    return str(path)


def test_busy_looping_worker_is_hung():
    step_option, rank_option = busy_loop_options()
    hang_timeout_s, spin_step, spin_rank = 8, 30, 2
    with Cluster(2, str(ROOT / "cluster-hang")) as c:
        h0, h1 = c.hosts
        program = first_generation_only(ROOT / "train_gpt_busy_once.sh",
                                        [step_option, str(spin_step), rank_option, str(spin_rank)])
        m = manager(c, "hang", c.hosts, steps=100000, program=program,
                    extra_args=["--hang_timeout_s", str(hang_timeout_s)], train_args=["--checkpoint_every", "10"])
        m.start()
        m.wait_step(spin_step - 1)
        last_step_at = time.time()
        m.wait_event("hang", timeout=hang_timeout_s + 60)
        hang = m.events("hang")[0]
        log("rank %d spins before step %d -> hang event after %.1f s: %s"
            % (spin_rank, spin_step, hang["unix_ms"] / 1000 - last_step_at, hang["reason"]))
        named = [r["rank"] for r in hang["ranks"]]
        assert named == [spin_rank], hang
        assert set(hang["waiting_ranks"]) == {0, 1, 2, 3} - {spin_rank}, hang
        assert hang["stalled_s"] >= hang_timeout_s, hang
        assert not m.events("worker_hung"), "heartbeats went on: no worker was silent (%s)" % m.events("worker_hung")
        m.wait_event("launch", count=2, timeout=60)
        second = m.events("launch")[1]
        assert second["resume_step"] >= 20 and hosts_of(second) == [h0.addr, h1.addr], second
        steps = wait_generation_steps(m, second["generation"], 20, 120)
        assert steps[-1][0] > spin_step, steps[-3:]  # past the step where rank 2 spun
        assert len(m.events("hang")) == 1, m.events("hang")
        stop_and_check_clean(c, m)


if __name__ == "__main__":
    run_tests([
        test_frozen_agent_workers_gone_and_store_untouched,
        test_killed_host_rejoins_without_a_machine_list_change,
        test_partitioned_host_ends_itself_and_rejoins_after_healing,
        test_preempted_host_readmitted_when_the_list_is_written_again,
        test_busy_looping_worker_is_hung,
    ])
