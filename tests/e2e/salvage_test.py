#!/usr/bin/env python3
"""Salvage end to end (docs/salvage.md): a sudden loss (kill -9, no notice)
between periodic checkpoints. The survivors report the step they hold; when
every stage still has a survivor, one per stage writes that step's
checkpoint and the job resumes from it with no step lost; when a stage lost
all its replicas, the job falls back to the periodic checkpoint. Two loopback
"hosts" (127.0.0.1, 127.0.0.2) of two slots, 2 stages x 2 replicas, the
example trainer; clustered placement puts replica 0 (ranks 0, 1) on the
first host and replica 1 (ranks 2, 3) on the second. The same flows over
real sshd are in ssh_cluster_test.py."""
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from varuna_e2e import (  # noqa: E402
    Manager, assert_losses_continue, assert_nothing_left, log, processes_of_job, run_tests, wait_for)

SOURCE = Path(__file__).resolve().parents[2]
ROOT = Path(os.environ.get("VARUNA_TEST_TMPDIR", tempfile.mkdtemp(prefix="varuna-salvage-")))
shutil.rmtree(ROOT, ignore_errors=True)
ROOT.mkdir(parents=True)
TWO_HOSTS = ["127.0.0.1 slots=2", "127.0.0.2 slots=2"]
SALVAGE_TIMEOUT_S = 20
# Kill -> the next generation launched, at most: the survivors' reports and
# the writes are each bounded by --salvage_timeout_s; the rest (noticing the
# loss, starting the next generation) takes seconds. Generous for a slow machine.
RECOVERY_BOUND_S = 2 * SALVAGE_TIMEOUT_S + 40
_port = [23000 + (os.getpid() % 200) * 40]


def manager(name, machines=TWO_HOSTS, extra_args=(), **kw):
    _port[0] += 10
    extra = ["--master_port", str(_port[0]), "--restart_backoff_s", "0.2", "--host_retry_s", "0",
             "--salvage_timeout_s", str(SALVAGE_TIMEOUT_S), *extra_args]
    return Manager(ROOT / name, machines, job="salvage-" + name + "-" + str(os.getpid()), extra_args=extra, **kw)


def workers_of_rank(m, rank):
    return [pid for pid, cmd in processes_of_job(m.job) if "train_gpt" in cmd and ("--rank %d " % rank) in cmd]


def processes_of_host(m, host):
    def on_host(pid, cmd):
        if ("--host %s " % host) in cmd + " ":
            return True
        try:
            return ("VARUNA_HOST=%s\0" % host).encode() in Path("/proc/%d/environ" % pid).read_bytes()
        except OSError:
            return False  # exited meanwhile
    return [pid for pid, cmd in processes_of_job(m.job) if on_host(pid, cmd)]


def kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reference_losses(name, machines, steps, **kw):
    ref = manager(name, machines=machines, steps=steps, **kw).start()
    assert ref.wait_exit() == 0, ref.tail()
    return ref.losses()


def test_a_host_killed_between_checkpoints_loses_no_step():
    """kill -9 of every process of 127.0.0.2 (replica 1) about 30 steps after the
    periodic checkpoint of step 50: replica 0 holds the step the job reached,
    writes it, and the job resumes from it on 127.0.0.1 as 2 x 1. Under the
    zero-bubble V schedule (zbv: two chunks per stage, stage 0 holding the
    model's first and last pieces, every backward ending in W tasks): the step
    a survivor holds, and what it writes (per piece), are the same as under
    any schedule."""
    # Steps to spare after the kill's step: state.json's step is a second
    # old, and a quiet machine trains ~50 steps a second.
    steps = 400
    zero_bubble = ["--schedule", "zbv"]
    m = manager("host", steps=steps, train_args=["--checkpoint_every", "50", *zero_bubble]).start()
    m.wait_step(80)
    victims = processes_of_host(m, "127.0.0.2")
    assert len(victims) == 3, victims  # the agent and its two workers
    killed_at = time.monotonic()
    kill(victims)
    m.wait_event("launch", count=2, timeout=RECOVERY_BOUND_S)
    log("kill -9 of a host -> next generation launched: %.2f s" % (time.monotonic() - killed_at))
    resumed = m.events("launch")[1]["resume_step"]
    if resumed % 50:  # (a kill right after the periodic checkpoint of that step finds it there: nothing written)
        meta = (m.store / ("varuna_ckpt_%d" % resumed) / "meta.json").read_text()  # before retention removes it
        assert '"salvaged"' in meta, meta
    assert m.wait_exit() == 0, m.tail()
    writing = m.events("salvage_writing")
    assert len(writing) == 1, m.events()
    launch = m.events("launch")[1]
    # steps_lost counts from the highest step any rank reported: 1 when a
    # dead rank finished the step's exchange and no survivor did (salvage.md);
    # 0 otherwise.
    assert launch["recovery"] == "salvage" and launch["steps_lost"] <= 1, launch
    assert launch["resume_step"] == writing[0]["step"] >= 80, (launch, writing)
    assert (launch["plan"]["stages"], launch["plan"]["replicas"]) == (2, 1), launch
    assert sorted(writing[0]["writers"]) == [0, 1], writing  # replica 0, the survivor
    assert not m.events("kill_all") and not m.events("salvage_abandoned")
    want = reference_losses("host-reference", ["127.0.0.1 slots=2"], steps, train_args=zero_bubble)
    assert_losses_continue(m.losses(), want, steps)
    assert_nothing_left(m.job)


def test_the_python_trainer_salvages_too():
    """The same host loss with examples/python/train_gpt.py: salvage lives in
    the runtime, under the Python front end as under C++ (its optimizer state
    comes from torch.optim through the bridge)."""
    # Steps to spare after step 30 (state.json's step is a second old, and
    # the job can train ~50 steps a second): the kill must land mid-training.
    steps = 400
    python = os.environ.get("VARUNA_PYTHON", str(SOURCE / ".venv" / "bin" / "python"))
    program = [python, str(SOURCE / "examples" / "python" / "train_gpt.py")]
    m = manager("python", steps=steps, program=program, train_args=["--checkpoint_every", "1000"]).start()
    m.wait_step(30)
    kill(processes_of_host(m, "127.0.0.2"))
    m.wait_event("launch", count=2, timeout=RECOVERY_BOUND_S)
    assert m.wait_exit() == 0, m.tail()
    launch = m.events("launch")[1]
    assert launch["recovery"] == "salvage" and launch["steps_lost"] <= 1 and launch["resume_step"] >= 30, launch
    want = reference_losses("python-reference", ["127.0.0.1 slots=2"], steps, program=program)
    assert_losses_continue(m.losses(), want, steps)
    assert_nothing_left(m.job)


def test_a_split_exchange_is_finished_from_the_relayed_result():
    """The split a peer dying during the job-wide exchange can leave, made
    deterministic (train_gpt --test_lose_exchange 1@60): the exchange of step 60
    completes on stage 0 and "fails" on both ranks of stage 1. Stage 0 holds
    60 with the exchange's result; stage 1 holds 59 and can finish 60. The
    manager relays the result in the write order, stage 1's writer applies
    step 60 itself, and the job resumes from 60 with its losses equal to an
    uninterrupted run's."""
    steps = 120
    m = manager("split", steps=steps, train_args=["--checkpoint_every", "1000", "--test_lose_exchange", "1@60"]).start()
    m.wait_event("launch", count=2, timeout=RECOVERY_BOUND_S + 120)
    assert m.wait_exit() == 0, m.tail()
    reports = {e["rank"]: e for e in m.events("salvage_report") if e["generation"] == 1}
    finishing = [r for r, e in reports.items() if e.get("finishable_step") == 60]
    assert len(finishing) == 2 and all(reports[r]["stage"] == 1 and reports[r]["step"] == 59 for r in finishing), reports
    assert all(e["step"] == 60 for r, e in reports.items() if r not in finishing), reports
    writing = m.events("salvage_writing")
    assert len(writing) == 1 and writing[0]["step"] == 60, writing
    assert len(writing[0]["finishing"]) == 1 and writing[0]["finishing"][0] in finishing, writing
    launch = m.events("launch")[1]
    assert launch["recovery"] == "salvage" and launch["resume_step"] == 60 and launch["steps_lost"] == 0, launch
    assert not m.events("salvage_abandoned")
    assert_losses_continue(m.losses(), reference_losses("split-reference", TWO_HOSTS, steps), steps)
    assert_nothing_left(m.job)


def test_a_replica_that_missed_the_buffer_broadcast_relays_the_exchange():
    """A model with BatchNorm buffers (train_gpt --batchnorm), 1 stage x 2
    replicas, one per host. train_gpt --test_lose_exchange 0@60/0 makes the
    exchange of step 60 "fail" under replica 0 only. Replica 1 finished it,
    applied step 60 and waits for replica 0's buffers, whose broadcast never
    comes: it vouches for no whole step, yet reports the exchange result of
    step 60. Replica 0 holds 59 and can finish 60 given that result: the
    manager relays it, replica 0 finishes and writes step 60, and the job
    resumes from 60 with its losses equal to an uninterrupted run's."""
    steps = 120
    machines = ["127.0.0.1 slots=1", "127.0.0.2 slots=1"]
    train = ["--checkpoint_every", "1000", "--batchnorm"]
    m = manager("broadcast", machines=machines, stages=1, steps=steps,
                train_args=train + ["--test_lose_exchange", "0@60/0"]).start()
    m.wait_event("launch", count=2, timeout=RECOVERY_BOUND_S + 120)
    assert m.wait_exit() == 0, m.tail()
    reports = {e["rank"]: e for e in m.events("salvage_report") if e["generation"] == 1}
    assert reports[0]["step"] == 59 and reports[0].get("finishable_step") == 60, reports
    assert reports[1]["step"] == -1 and reports[1].get("exchange_step") == 60, reports
    writing = m.events("salvage_writing")
    assert len(writing) == 1 and writing[0]["step"] == 60 and writing[0]["finishing"] == [0], writing
    launch = m.events("launch")[1]
    assert launch["recovery"] == "salvage" and launch["resume_step"] == 60 and launch["steps_lost"] == 0, launch
    want = reference_losses("broadcast-reference", machines, steps, stages=1, train_args=train)
    # Neither rank's step() of step 60 returned (no loss line): the loss of the
    # step replica 0 finished is in its log, from the relayed exchange result.
    got = m.losses(0)
    assert 59 not in got, sorted(got)
    finished = re.search(r"finished step 60 from the exchange result run_varuna relayed \(loss ([-0-9.e+]+)\)",
                         m.worker_log("127.0.0.1", 1, 0))
    assert finished, m.worker_log("127.0.0.1", 1, 0)
    got[59] = float(finished.group(1))
    assert_losses_continue(got, want, steps)
    assert_nothing_left(m.job)


def test_a_whole_stage_killed_falls_back_to_the_periodic_checkpoint():
    """kill -9 of stage 0's two workers (ranks 0 and 2, one per host): no
    survivor holds stage 0, so the job resumes from its newest periodic
    checkpoint (step 100, or 200 when a loaded machine was slow to find the
    victims and the job had passed it) and the event log says how many steps
    were lost."""
    steps = 260
    m = manager("stage", steps=steps, train_args=["--checkpoint_every", "100"]).start()
    m.wait_step(110)
    victims = workers_of_rank(m, 0) + workers_of_rank(m, 2)
    assert len(victims) == 2, victims
    kill(victims)
    m.wait_event("launch", count=2, timeout=RECOVERY_BOUND_S)
    assert m.wait_exit() == 0, m.tail()
    abandoned = m.events("salvage_abandoned")
    assert len(abandoned) == 1 and "stage 0" in abandoned[0]["reason"], abandoned
    launch = m.events("launch")[1]
    assert launch["recovery"] == "checkpoint" and launch["resume_step"] in (100, 200), launch
    assert launch["steps_lost"] >= 1, launch  # at least the steps past the checkpoint
    assert (launch["plan"]["stages"], launch["plan"]["replicas"]) == (2, 2), launch
    assert not m.events("salvage_writing")
    assert_nothing_left(m.job)


def test_kills_at_random_moments_never_mix_steps():
    """20 trials in one job: kill -9 of one random worker at a random moment of
    a step (some land inside the job-wide exchange). Every trial must end within
    the bound, salvaged: resumed from the step written, at most the one step a
    dead rank alone finished lost. A kill that split the exchange (one stage's
    survivors finished it, another's failed it) is finished from the relayed
    result (docs/salvage.md). The whole run's losses must equal an
    uninterrupted 2 x 2 run's: a checkpoint whose pieces came from two steps
    would show as a jump."""
    seed = int(os.environ.get("VARUNA_SALVAGE_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    trials = int(os.environ.get("VARUNA_SALVAGE_TRIALS", "20"))
    log("seed %d, %d trials" % (seed, trials))
    # Runs until stopped (SIGTERM) after the trials.
    m = manager("random", steps=1000000, extra_args=["--max_failures", "1000"],
                train_args=["--checkpoint_every", "100000"]).start()
    bounds = []
    salvaged = finished = 0
    for trial in range(trials):
        m.wait_step(m.step() + 4)
        launches = len(m.events("launch"))
        rank = rng.randrange(4)
        victims = wait_for("rank %d's worker" % rank, lambda: workers_of_rank(m, rank), 30)
        time.sleep(rng.uniform(0, 0.2))  # a random moment of a step (this tiny model takes 30-100 ms a step)
        killed_at = time.monotonic()
        kill(victims[-1:])
        m.wait_event("launch", count=launches + 1, timeout=RECOVERY_BOUND_S)
        bounds.append(time.monotonic() - killed_at)
        launch = m.events("launch")[-1]
        assert launch["recovery"] == "salvage", (trial, launch, m.events("salvage_abandoned"))
        writing = m.events("salvage_writing")[-1]
        assert launch["resume_step"] == writing["step"] and launch["steps_lost"] <= 1, (trial, launch, writing)
        salvaged += 1
        if writing["finishing"]:
            finished += 1
            log("trial %d: the kill split the job-wide exchange; ranks %s finished step %d from the relayed result"
                % (trial, writing["finishing"], writing["step"]))
    log("kill -> relaunch over %d trials: median %.2f s, max %.2f s (bound %d s); %d salvaged, %d of them "
        "finishing a split exchange from the relayed result"
        % (trials, sorted(bounds)[len(bounds) // 2], max(bounds), RECOVERY_BOUND_S, salvaged, finished))
    m.kill(signal.SIGTERM)  # checkpoint and stop
    assert m.wait_exit(timeout=300) == 0, m.tail()
    got = m.losses()
    steps = max(got) + 1
    want = reference_losses("random-reference", TWO_HOSTS, steps)
    # Rank 0 logs a step's loss after step() returns: killed in between, the
    # step it finished (the last one salvaged) has no line. Only those may miss.
    missing = set(range(steps)) - set(got)
    allowed = {e["resume_step"] - 1 for e in m.events("launch")[1:]}
    assert missing <= allowed, (sorted(missing), sorted(allowed))
    got.update({s: want[s] for s in missing})
    assert_losses_continue(got, want, steps)
    assert_nothing_left(m.job)


if __name__ == "__main__":
    run_tests([test_a_host_killed_between_checkpoints_loses_no_step,
               test_the_python_trainer_salvages_too,
               test_a_split_exchange_is_finished_from_the_relayed_result,
               test_a_replica_that_missed_the_buffer_broadcast_relays_the_exchange,
               test_a_whole_stage_killed_falls_back_to_the_periodic_checkpoint,
               test_kills_at_random_moments_never_mix_steps])
