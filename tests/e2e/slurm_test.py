#!/usr/bin/env python3
"""run_varuna under a real Slurm (slurm_cluster.py: slurmctld, a slurmd per
network-namespace host, munge): the elastic way of config/slurm, a manager
with no machine list and a job array of single-node tasks whose agents join it,
run with the very batch script of config/slurm/varuna-agents.sbatch, and one
allocation with run_varuna inside (config/slurm/varuna-allocation.sbatch).
The cluster's job credentials last 10 s (slurm_cluster.py), so a requeued
job runs again about 10 s after its requeue rather than Slurm's default 2
minutes."""
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import SlurmCluster  # noqa: E402
from varuna_e2e import (  # noqa: E402
    BIN, TINY_MODEL, TRAIN_DIR, Manager, assert_losses_continue, log, run_tests, wait_for)

SOURCE = Path(__file__).resolve().parents[2]
ROOT = Path(os.environ.get("VARUNA_TEST_TMPDIR", tempfile.mkdtemp(prefix="varuna-slurm-")))
shutil.rmtree(ROOT, ignore_errors=True)
ROOT.mkdir(parents=True)
HOSTS = 4


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def array_tasks(slurm, job_id):
    """{array task index: its scontrol record} of a job array."""
    return {int(r["ArrayTaskId"]): r for r in slurm.job_states(job_id).values() if r.get("ArrayTaskId", "").isdigit()}


def running_hosts(m):
    launches = m.events("launch")
    return launches[-1]["plan"]["hosts"] if launches else []


SLURM = None  # the cluster, made in main()


def test_a_job_array_joins_grows_is_preempted_and_requeued():
    slurm = SLURM
    net = slurm.net
    addrs = [h.addr for h in net.hosts]
    # A tenth of a core per node: the run spans Slurm's own delays (a
    # preemption decision, the preempting job) in a few hundred steps, not
    # thousands, so its losses can be held against an uninterrupted run
    # (float noise of the width changes grows with the steps).
    for h in net.hosts:
        net.slow_host(h, 0.1)
    job = "slurm-array-%d" % os.getpid()
    port = free_port()
    m = Manager(ROOT / "array", None, stages=2, batch=16, chunk=4, steps=100000, job=job,
                prefix=["ip", "netns", "exec", net.head_ns],
                extra_args=["--min_hosts", "2", "--manager_ip", net.head_addr, "--port", str(port),
                            "--master_port", str(21000 + os.getpid() % 250 * 20)],
                train_args=["--checkpoint_every", "1000"]).start()
    (m.state_dir).mkdir(parents=True, exist_ok=True)
    (m.state_dir / "manager_address").write_text("%s:%d\n" % (net.head_addr, port))
    env = ["--export=ALL,VARUNA_STATE=%s,VARUNA_JOB=%s,VARUNA_SLOTS=1,PATH=%s:%s"
           % (m.state_dir, job, BIN, os.environ["PATH"])]
    array = slurm.sbatch((SOURCE / "config" / "slurm" / "varuna-agents.sbatch").read_text(), *env,
                         "--array=0-%d" % (HOSTS - 1), "--partition=low", "--gres=none",
                         "--output=%s/task-%%a.log" % ROOT)
    log("job array %d submitted" % array)

    # Training starts at --min_hosts 2 and grows as the rest join: 2 stages x
    # 1..2 replicas, one worker per host.
    m.wait_event("launch", timeout=120)
    wait_for("all %d hosts in the plan (launches: %s)" % (HOSTS, [e["plan"]["hosts"] for e in m.events("launch")]),
             lambda: len(running_hosts(m)) == HOSTS or m._died(), 180)
    m.wait_step(m.events("launch")[-1]["resume_step"] + 20)
    grown = len(m.events("launch"))
    assert m.events("launch")[0]["plan"]["hosts"] != running_hosts(m), "never grew"

    # A higher-priority job takes two nodes: Slurm preempts the two tasks
    # there (SIGTERM, GraceTime 15 s, then SIGKILL, then requeue). Their agents
    # turn the SIGTERM into notices: the job morphs onto the other two hosts
    # before the grace is out, losing no step.
    high = slurm.sbatch("#!/bin/bash\nsleep 10\n", "--partition=high", "--nodes=2", "--nodelist=n2,n3",
                        "--output=/dev/null")
    m.wait_event("preempt_notice", count=2, timeout=120)
    notices = m.events("preempt_notice")
    assert sorted(n["host"] for n in notices) == sorted(addrs[2:]), notices
    wait_for("the job on the two remaining hosts",
             lambda: sorted(running_hosts(m)) == sorted(addrs[:2]) or m._died(), 60)
    shrunk = m.events("launch")[-1]
    assert shrunk["recovery"] == "checkpoint" and shrunk.get("steps_lost", 0) == 0, shrunk
    morphed_at = shrunk["unix_ms"] / 1000
    assert all(morphed_at < n["deadline_unix_ms"] / 1000 for n in notices), (morphed_at, notices)
    assert not m.events("host_lost"), m.events("host_lost")  # they left, none was lost
    wait_for("the preempted tasks requeued", lambda: all(
        int(array_tasks(slurm, array)[i].get("Restarts", "0")) >= 1 for i in (2, 3)), 60)
    for i in (2, 3):
        wait_for("no agent left on n%d" % i, lambda: not slurm.processes_on(i, "varuna_agent"), 30)

    # The high-priority job ends; the requeued tasks run again, join again,
    # and the job grows back onto all four hosts.
    wait_for("the high-priority job done", lambda: slurm.job_states(high).get(str(high), {}).get("JobState")
             in ("COMPLETED", None), 60)
    wait_for("the job grown back onto %d hosts" % HOSTS,
             lambda: (len(m.events("launch")) > grown + 1 and len(running_hosts(m)) == HOSTS) or m._died(), 120)
    assert len(m.events("host_joined")) == HOSTS + 2, m.events("host_joined")

    # The manager stops (SIGTERM: a checkpoint, then exit); every agent is
    # released and its task ends; Slurm and the nodes' process tables agree
    # that nothing is left.
    assert m.stop_once_trained_on(launches=len(m.events("launch"))) == 0, m.tail()
    wait_for("every task of the array completed", lambda: all(
        r["JobState"] == "COMPLETED" for r in array_tasks(slurm, array).values()) and not slurm.jobs(), 60)
    for i in range(HOSTS):
        assert not slurm.processes_on(i, "varuna_agent") and not slurm.processes_on(i, "train_gpt"), i
    for i in range(HOSTS):
        log("task %d:" % i, (ROOT / ("task-%d.log" % i)).read_text()[-300:].replace("\n", " | "))

    # Through the grows and the preemption it trained what an uninterrupted
    # run of the same global batches trains.
    got = m.losses()
    steps = max(got) + 1
    ref = Manager(ROOT / "array-reference", ["127.0.0.1 slots=2"], stages=2, batch=16, chunk=4, steps=steps,
                  job=job + "-ref", extra_args=["--port", "0", "--master_port", str(26000 + os.getpid() % 250 * 20)])
    ref.start()
    assert ref.wait_exit() == 0, ref.tail()
    assert_losses_continue(got, ref.losses(), steps)


def job_state(slurm, job_id):
    return slurm.job_states(job_id).get(str(job_id), {}).get("JobState")


def test_one_allocation_trains_stops_on_scancel_and_a_requeue_resumes():
    """config/slurm/varuna-allocation.sbatch: run_varuna inside the batch
    script, one agent per node through srun. `scancel --batch --signal=TERM`
    checkpoints and exits; `scontrol requeue` runs it again from that step."""
    slurm = SLURM
    name = "slurm-alloc-%d" % os.getpid()
    state, store, dump = ROOT / "alloc" / "state", ROOT / "alloc" / "store", ROOT / "alloc" / "dump"
    dump.mkdir(parents=True)
    program = " ".join(["./train_gpt", "--steps", "100000", "--checkpoint_every", "25", *TINY_MODEL,
                        "--dump_dir", str(dump)])
    env = ("--export=ALL,VARUNA_STATE=%s,VARUNA_STORE=%s,VARUNA_CODE=%s,VARUNA_SLOTS=1,VARUNA_PORT=%d,"
           "VARUNA_ARGS=--nstages 2 --chunk_size 4 --batch_size 16,VARUNA_PROGRAM=%s,PATH=%s:%s"
           % (state, store, TRAIN_DIR, free_port(), program, BIN, os.environ["PATH"]))
    job = slurm.sbatch((SOURCE / "config" / "slurm" / "varuna-allocation.sbatch").read_text(), env,
                       "--job-name=" + name, "--partition=high", "--nodes=2", "--gres=none",
                       "--output=%s/alloc-%%j.log" % ROOT)
    events = lambda kind: [e for e in read_events(state) if e["event"] == kind]  # noqa: E731
    try:
        for run in range(2):
            wait_for("launch %d of the allocation (job log:\n%s)" % (run + 1, tail(ROOT / ("alloc-%d.log" % job))),
                     lambda: len(events("launch")) > run, 120)
            launch = events("launch")[run]
            assert sorted(launch["plan"]["hosts"]) == sorted(h.addr for h in slurm.net.hosts[:2]), launch
            wait_for("steps after launch %d" % (run + 1), lambda: progress(state) >= launch.get("resume_step", 0) + 30,
                     120)
            slurm.run(["scancel", "--batch", "--signal=TERM", str(job)])
            wait_for("the job completed after its SIGTERM", lambda: job_state(slurm, job) == "COMPLETED", 120)
            log("run %d: stopped at step %d" % (run + 1, progress(state)))
            if run == 0:
                checkpointed = newest_checkpoint(store)
                assert checkpointed > 0, list(store.iterdir())
                slurm.run(["scontrol", "requeue", str(job)])
                wait_for("requeued", lambda: job_state(slurm, job) == "PENDING", 60)
                log("requeued:", {k: v for k, v in slurm.job_states(job).get(str(job), {}).items()
                                  if k in ("JobState", "Reason", "StartTime", "Restarts")})
        resumed = events("launch")[1]
        assert resumed["resume_step"] == checkpointed, (resumed, checkpointed)
    finally:
        slurm.run(["scancel", str(job)], check=False)
    wait_for("nothing of the job left on the nodes", lambda: not any(
        slurm.processes_on(i, "varuna_agent") or slurm.processes_on(i, "run_varuna") or
        slurm.processes_on(i, "train_gpt") for i in range(HOSTS)), 30)


def read_events(state):
    path = state / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def progress(state):
    try:
        return json.loads((state / "state.json").read_text()).get("progress", {}).get("step", -1)
    except (OSError, ValueError):
        return -1


def newest_checkpoint(store):
    steps = [int(p.name.split("_")[-1]) for p in store.glob("varuna_ckpt_*") if p.name.split("_")[-1].isdigit()
             and (p / "manifest.json").exists()]
    return max(steps, default=-1)


def tail(path, lines=20):
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(none)"


def main():
    if os.geteuid() != 0:
        print("slurm_test: needs root (network namespaces)")
        sys.exit(77)
    global SLURM
    missing = [p for p in ("slurmctld", "slurmd", "munged", "sbatch") if not shutil.which(p)]
    if missing:
        print("slurm_test: %s not installed (scripts/setup.sh installs Debian's slurmctld, slurmd, slurm-client "
              "and munge)" % ", ".join(missing))
        sys.exit(77)
    with SlurmCluster(HOSTS, str(ROOT / "slurm"), grace_s=15) as SLURM:
        run_tests([test_a_job_array_joins_grows_is_preempted_and_requeued,
                   test_one_allocation_trains_stops_on_scancel_and_a_requeue_resumes])


if __name__ == "__main__":
    main()
