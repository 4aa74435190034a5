#!/usr/bin/env python3
"""run_varuna end to end on this machine: two "hosts" on loopback addresses
(127.0.0.1 and 127.0.0.2, both started without SSH), the example trainer, real
agents and workers. Each scenario injects one fault and checks the job's
outcome, its event log and that no process is left behind.
(The SSH paths are in ssh_cluster_test.py.)"""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wire_tap import LoopbackTap, credentials_of_job  # noqa: E402
from varuna_e2e import (  # noqa: E402
    BIN, TINY_MODEL, Manager, assert_losses_continue, assert_nothing_left,
    assert_resumed_exactly, log, managers, processes_of_job, run_tests, wait_for)

SOURCE = Path(__file__).resolve().parents[2]
ROOT = Path(os.environ.get("VARUNA_TEST_TMPDIR", tempfile.mkdtemp(prefix="varuna-e2e-")))
shutil.rmtree(ROOT, ignore_errors=True)  # nothing of an earlier run (state, checkpoints) may leak into this one
ROOT.mkdir(parents=True)
TWO_HOSTS = ["127.0.0.1 slots=2", "127.0.0.2 slots=2"]


manager = managers(ROOT, 21000 + (os.getpid() % 200) * 40, "e2e", TWO_HOSTS)


def test_preemption_morphs_2x2_to_2x1_and_resumes_exactly():
    steps = 160
    m = manager("preempt", steps=steps).start()
    m.wait_step(30)
    # Taken in 120 s: past the job's end (after its deadline the host would be tried again and come back).
    r = m.notify_preempt("127.0.0.2", "--in_seconds", "120")
    assert r.returncode == 0, r.stderr
    assert m.wait_exit() == 0, m.tail()
    launches = m.events("launch")
    assert [(e["plan"]["stages"], e["plan"]["replicas"]) for e in launches] == [(2, 2), (2, 1)], launches
    assert launches[1]["resume_step"] > 0
    morph = m.events("morph_complete")
    assert len(morph) == 1 and "preemption of 127.0.0.2" in morph[0]["cause"], morph
    log("morph phases:", json.dumps(morph[0]))
    assert "morph done" in m.output() and "summary" in m.output()
    # An uninterrupted 2x1 run sees the same global batches: the same losses
    # but for the float noise of the width change.
    ref = manager("preempt-reference", machines=["127.0.0.1 slots=2"], steps=steps).start()
    assert ref.wait_exit() == 0, ref.tail()
    assert_losses_continue(m.losses(), ref.losses(), steps)
    # Strictly: a 2x1 job started from a copy of the morph's checkpoint (and
    # nothing newer) computes the losses the morphed job did after it.
    resume = launches[1]["resume_step"]
    again = manager("preempt-from-copy", machines=["127.0.0.1 slots=2"], steps=steps)
    shutil.copytree(m.store / ("varuna_ckpt_%d" % resume), again.store / ("varuna_ckpt_%d" % resume))
    again.start()
    assert again.wait_exit() == 0, again.tail()
    assert again.events("launch")[0]["resume_step"] == resume
    assert_resumed_exactly(m.losses(), again.losses(), resume)
    assert_nothing_left(m.job)


def test_python_trainer_morphs_and_resumes_exactly():
    """The Python front end under run_varuna: examples/python/train_gpt.py
    (run by the project's Python, where setup.sh put the varuna package) gets
    the launcher's arguments, reports, checkpoints on the notice and resumes
    as 2x1 exactly where a 2x1 job started from that checkpoint does."""
    # Steps to spare after the notice: state.json's step is a second old and
    # the tiny model trains tens of steps a second (with 60 steps, a loaded
    # CI machine once took the notice at step 59, leaving nothing to compare).
    steps = 200
    python = os.environ.get("VARUNA_PYTHON", str(SOURCE / ".venv" / "bin" / "python"))
    program = [python, str(SOURCE / "examples" / "python" / "train_gpt.py")]
    m = manager("python", steps=steps, program=program).start()
    m.wait_step(15)
    r = m.notify_preempt("127.0.0.2", "--in_seconds", "120")
    assert r.returncode == 0, r.stderr
    assert m.wait_exit() == 0, m.tail()
    launches = m.events("launch")
    assert [(e["plan"]["stages"], e["plan"]["replicas"]) for e in launches] == [(2, 2), (2, 1)], launches
    resume = launches[1]["resume_step"]
    assert resume > 0, launches
    again = manager("python-from-copy", machines=["127.0.0.1 slots=2"], steps=steps, program=program)
    shutil.copytree(m.store / ("varuna_ckpt_%d" % resume), again.store / ("varuna_ckpt_%d" % resume))
    again.start()
    assert again.wait_exit() == 0, again.tail()
    assert_resumed_exactly(m.losses(), again.losses(), resume)
    assert_nothing_left(m.job)


def test_sigstop_worker_is_detected_by_heartbeat_timeout():
    m = manager("sigstop", steps=400, extra_args=["--heartbeat_timeout_s", "2", "--restart_backoff_s", "0.2"],
                train_args=["--checkpoint_every", "20"]).start()
    m.wait_step(25)
    victim = [p for p, cmd in processes_of_job(m.job) if "train_gpt" in cmd and "--rank 3 " in cmd]
    assert victim, processes_of_job(m.job)
    os.kill(victim[0], signal.SIGSTOP)
    hung = m.wait_event("worker_hung", timeout=30)
    assert m.events("worker_hung")[0]["rank"] == 3
    m.wait_event("launch", count=2, timeout=60)
    second = m.events("launch")[1]
    assert second["resume_step"] >= 20, second
    assert m.wait_exit() == 0, m.tail()
    assert_nothing_left(m.job)
    del hung


def test_worker_killed_relaunches_from_latest_checkpoint():
    # --no_salvage: the rollback path (salvage_test.py has the salvage).
    m = manager("kill9", steps=300, extra_args=["--restart_backoff_s", "0.2", "--no_salvage"],
                train_args=["--checkpoint_every", "20"]).start()
    m.wait_step(45)
    victim = [p for p, cmd in processes_of_job(m.job) if "train_gpt" in cmd and "--rank 1 " in cmd]
    t0 = time.monotonic()
    os.kill(victim[0], signal.SIGKILL)
    m.wait_event("kill_all", timeout=10)
    log("kill -9 -> manager decision: %.2f s" % (time.monotonic() - t0))
    assert m.wait_exit() == 0, m.tail()
    launches = m.events("launch")
    assert len(launches) == 2 and launches[1]["resume_step"] >= 40, launches
    assert (launches[1]["plan"]["stages"], launches[1]["plan"]["replicas"]) == (2, 2)
    exited = [e for e in m.events("worker_exited") if e["rank"] == 1]
    assert exited and exited[0]["signal"] == 9, exited
    assert_nothing_left(m.job)


def test_every_process_of_a_host_killed():
    """kill -9 of the agent and the workers of 127.0.0.2 (the kernel closes their
    connections): the manager decides at once and carries on with 127.0.0.1,
    starts the host's agent again after --host_retry_s and grows back to both."""
    m = manager("host-killed", steps=100000, extra_args=["--restart_backoff_s", "0.2", "--no_salvage"],
                train_args=["--checkpoint_every", "20"]).start()
    m.wait_step(45)
    on_host = [p for p, cmd in processes_of_job(m.job)
               if ("--host 127.0.0.2 " in cmd + " ") or b"VARUNA_HOST=127.0.0.2\0" in Path("/proc/%d/environ" % p).read_bytes()]
    assert len(on_host) == 3, on_host  # the agent and its two workers
    t0 = time.monotonic()
    for pid in on_host:
        os.kill(pid, signal.SIGKILL)
    m.wait_event("kill_all", timeout=10)
    log("kill -9 of a host's processes -> manager decision: %.2f s" % (time.monotonic() - t0))
    m.wait_event("host_back", timeout=30)
    log("kill -9 of a host's processes -> host back: %.2f s" % (time.monotonic() - t0))
    assert m.stop_once_trained_on(launches=3) == 0, m.tail()
    launches = m.events("launch")
    assert launches[1]["plan"]["hosts"] == ["127.0.0.1"] and launches[1]["resume_step"] >= 40, launches
    assert launches[-1]["plan"]["hosts"] == ["127.0.0.1", "127.0.0.2"], launches
    assert m.events("host_lost")[0]["host"] == "127.0.0.2"
    back = m.events("host_back")[0]
    assert back["host"] == "127.0.0.2" and back["why"] == "lost" and back["out_s"] >= 2, back
    assert_nothing_left(m.job)


def test_host_added_to_machine_list_grows_the_job():
    trace = ROOT / "grow-trace"  # step timelines: each generation's files stay apart
    m = manager("grow", machines=["127.0.0.1 slots=2"], steps=100000,
                train_args=["--trace_dir", str(trace)]).start()
    m.wait_step(20)
    m.write_machines(TWO_HOSTS)
    m.wait_event("machine_list_changed", timeout=10)
    assert m.stop_once_trained_on(launches=2) == 0, m.tail()
    plans = [(e["plan"]["stages"], e["plan"]["replicas"]) for e in m.events("launch")]
    assert plans == [(2, 1), (2, 2)], plans
    assert_nothing_left(m.job)
    generations = [e["generation"] for e in m.events("launch")]
    files = sorted(p.name for p in trace.glob("*_trace.json"))
    expected = sorted([f"gen{generations[0]}_rank{r}_trace.json" for r in range(2)]
                      + [f"gen{generations[1]}_rank{r}_trace.json" for r in range(4)])
    assert files == expected, (files, expected)
    sys.path.insert(0, str(SOURCE / "scripts"))
    import pipeline_trace
    _, pipelines = pipeline_trace.summarize(str(trace), 1)
    assert sorted((p["generation"], p["replica"]) for p in pipelines) == [
        (generations[0], 0), (generations[1], 0), (generations[1], 1)], pipelines


def test_preempted_host_comes_back_when_the_list_is_written_again():
    """A preempted host (taken in 10 min) stays out; the machine list written
    again with the same text brings it back at once, and the job grows back."""
    m = manager("preempt-back", steps=100000, train_args=["--checkpoint_every", "20"]).start()
    m.wait_step(20)
    r = m.notify_preempt("127.0.0.2", "--in_seconds", "600")
    assert r.returncode == 0, r.stderr
    m.wait_event("launch", count=2, timeout=60)
    assert m.events("launch")[1]["plan"]["hosts"] == ["127.0.0.1"], m.events("launch")
    wait_for("the preempted host's agent released",
             lambda: m.state().get("hosts", {}).get("127.0.0.2", {}).get("agent") == "gone", 30)
    status = subprocess.run([str(BIN / "run_varuna"), "status", "--state_dir", str(m.state_dir)],
                            capture_output=True, text=True, timeout=30)
    line = [l for l in status.stdout.splitlines() if "127.0.0.2" in l]
    log("status:", line)
    assert line and "out" in line[0] and "preempted" in line[0], status.stdout
    t0 = time.monotonic()
    m.write_machines(TWO_HOSTS)  # the same text
    m.wait_event("host_back", timeout=30)
    log("machine list written -> host back: %.2f s" % (time.monotonic() - t0))
    assert m.stop_once_trained_on(launches=3) == 0, m.tail()
    launches = m.events("launch")
    assert launches[-1]["plan"]["hosts"] == ["127.0.0.1", "127.0.0.2"], launches
    back = m.events("host_back")[0]
    assert back["host"] == "127.0.0.2" and back["why"] == "preempted", back
    assert m.events("hosts_readmitted"), m.events()
    assert_nothing_left(m.job)


def agent_of(m, host):
    """The pid of the agent of `host` in m's job, or None."""
    found = [pid for pid, cmd in processes_of_job(m.job) if "varuna_agent" in cmd and ("--host %s " % host) in cmd + " "]
    return found[0] if found else None


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path("/proc/%d/status" % pid)
    try:
        return "zombie" not in status.read_text()
    except OSError:
        return False


def test_an_agents_sigterm_is_a_preemption_notice_each_time_the_host_comes_back():
    """Schedulers announce a machine's end with SIGTERM to the job's processes
    there and SIGKILL a grace time later (Slurm's preemption GraceTime and
    --signal, Kubernetes' terminationGracePeriodSeconds). With
    --agent_sigterm_notice_s G the agent takes its SIGTERM as a notice that its
    host goes in G s: the job morphs onto the other host with no step lost and
    the agent leaves long before G. Then, as a requeued task would, the host
    comes back (the machine list written again), the job grows back, and the
    next SIGTERM is handled the same way."""
    grace = 60
    m = manager("sigterm-notice", steps=100000, extra_args=["--agent_sigterm_notice_s", str(grace)],
                train_args=["--checkpoint_every", "1000"]).start()
    for round_ in range(2):
        m.wait_event("launch", count=2 * round_ + 1, timeout=60)
        m.wait_step(m.events("launch")[-1]["resume_step"] + 20)
        agent = wait_for("the agent of 127.0.0.2", lambda: agent_of(m, "127.0.0.2"), 30)
        sent = time.monotonic()
        os.kill(agent, signal.SIGTERM)
        m.wait_event("preempt_notice", count=round_ + 1, timeout=30)
        notice = m.events("preempt_notice")[round_]
        ahead_s = notice["deadline_unix_ms"] / 1000 - time.time()
        assert notice["host"] == "127.0.0.2" and grace - 15 < ahead_s <= grace, (notice, ahead_s)
        m.wait_event("launch", count=2 * round_ + 2, timeout=60)
        launch = m.events("launch")[-1]
        assert launch["plan"]["hosts"] == ["127.0.0.1"], launch
        assert launch["recovery"] == "checkpoint" and launch.get("steps_lost", 0) == 0, launch
        wait_for("the SIGTERMed agent gone", lambda: not alive(agent), grace / 2)
        log("round %d: SIGTERM -> morph done, agent gone: %.2f s (grace %d s), resumed at step %d"
            % (round_, time.monotonic() - sent, grace, launch["resume_step"]))
        m.write_machines(TWO_HOSTS)  # the requeued task's host is back
        m.wait_event("host_back", count=round_ + 1, timeout=30)
    assert m.stop_once_trained_on(launches=5) == 0, m.tail()
    hosts = [e["plan"]["hosts"] for e in m.events("launch")]
    assert hosts == [["127.0.0.1", "127.0.0.2"], ["127.0.0.1"]] * 2 + [["127.0.0.1", "127.0.0.2"]], hosts
    assert not m.events("kill_all"), m.events()
    assert_nothing_left(m.job)


def test_no_morphing_stops_on_the_first_failure():
    env_file = ROOT / "no-morphing.env"
    env_file.write_text("# from the env file\nVARUNA_E2E_MARK=from-env-file\n")
    # A tap on the loopback wire for the whole job: the control plane is TLS,
    # so no credential, env-file value or message is in it in clear.
    tap = LoopbackTap() if os.geteuid() == 0 else None
    m = manager("no-morphing", steps=100000, extra_args=["--no_morphing", "--env_file", str(env_file)]).start()
    m.wait_step(10)
    if tap:
        wire = tap.close()
        secrets = credentials_of_job(m, ["127.0.0.1", "127.0.0.2"])
        port = int(m.state()["address"].rsplit(":", 1)[1]).to_bytes(2, "big")
        assert wire.count(port) > 20, "the tap saw no control traffic (%d bytes captured)" % len(wire)
        for what, value in secrets.items():
            assert value not in wire, "%s crossed the wire in clear" % what
        for clear in (b"from-env-file", b'"step_report"', b'"launch_workers"', b'"hello"'):
            assert clear not in wire, "%r crossed the wire in clear" % clear
        log("tap: %d bytes on loopback, no credential or message in clear" % len(wire))
    # The workers, not their agents (whose command line names the program too).
    workers = [p for p, cmd in processes_of_job(m.job) if "train_gpt" in cmd and "varuna_agent" not in cmd]
    environ = Path("/proc/%d/environ" % workers[0]).read_bytes()
    assert b"VARUNA_E2E_MARK=from-env-file\0" in environ, "the env file did not reach the workers"
    # It travelled on the agents' stdin, not on a command line (`ps` shows those to everyone).
    for pid, cmd in processes_of_job(m.job):
        assert "from-env-file" not in cmd, cmd
    os.kill(workers[0], signal.SIGKILL)
    assert m.wait_exit(60) == 1, m.tail()
    assert "morphing is off" in m.output(), m.tail()
    assert len(m.events("launch")) == 1
    assert_nothing_left(m.job)


def test_sigterm_checkpoints_and_stops():
    m = manager("sigterm", steps=100000).start()
    m.wait_step(20)
    m.kill(signal.SIGTERM)
    assert m.wait_exit() == 0, m.tail()
    state = m.state()
    assert state["phase"] == "finished" and state["last_checkpoint_step"] >= 20, state
    assert_nothing_left(m.job)


def test_head_node_agents_and_workers_run_as_the_jobs_user():
    """run_varuna as root with ssh_user naming an unprivileged account: the
    agents it starts on this machine's own addresses (no SSH) and their
    workers run as that account, as an SSH login would, never as root; the
    job trains and checkpoints into a store that account owns."""
    if os.geteuid() != 0:
        log("skipped: run_varuna must be root to start agents as another user")
        return
    nobody = 65534
    workdir = ROOT / "as-user"
    (workdir / "store").mkdir(parents=True, exist_ok=True)
    (workdir / "dump").mkdir(parents=True, exist_ok=True)
    for path in (workdir, workdir / "store", workdir / "dump"):
        os.chown(path, nobody, nobody)
    m = manager("as-user", steps=100000, extra_args=["--ssh_user", "nobody"]).start()
    m.wait_step(10)
    procs = processes_of_job(m.job)
    agents = [pid for pid, cmd in procs if "varuna_agent" in cmd]
    workers = [pid for pid, cmd in procs if "varuna_agent" not in cmd]
    assert len(agents) == 2 and len(workers) == 4, procs
    for pid, cmd in procs:
        status = Path("/proc/%d/status" % pid).read_text()
        uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
        assert uids == [str(nobody)] * 4, (cmd, uids)  # real, effective, saved, filesystem
    m.kill(signal.SIGTERM)
    assert m.wait_exit() == 0, m.tail()
    state = m.state()
    assert state["phase"] == "finished" and state["last_checkpoint_step"] >= 10, state
    # The workers wrote the checkpoint (varuna_job.json is run_varuna's own record).
    written = [p for p in m.store.rglob("*") if p.name != "varuna_job.json"]
    assert written and {p.stat().st_uid for p in written} == {nobody}, [(str(p), p.stat().st_uid) for p in written]
    assert "run as root" not in m.output()
    assert_nothing_left(m.job)


def make_profile(name):
    """Profiles the tiny model with 2 processes (profile_gpt under varuna_launch.py)."""
    out = ROOT / name
    out.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "scripts" / "varuna_launch.py"),
                        "--nstages", "2", "--chunk_size", "1", "--batch_size", "1", "--",
                        str(BIN.parent / "examples" / "gpt" / "profile_gpt"), "--profile_dir", str(out),
                        "--micro_batch_sizes", "1,2,4", "--repetitions", "4", *TINY_MODEL],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return out / "profile.json"


def test_autoconfig_plans_from_a_profile_and_replans_after_a_morph():
    profile = make_profile("autoconfig-profile")
    machines = ROOT / "dry-machines.txt"
    machines.write_text("\n".join(TWO_HOSTS) + "\n")
    dry = subprocess.run([str(BIN / "run_varuna"), "--dry_run", "--machine_list", str(machines), "--batch_size", "16",
                          "--profile", str(profile), "--global_store", str(ROOT / "dry-store"), "--", "./train_gpt"],
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "AutoConfig chose" in dry.stdout and "plan:" in dry.stdout, dry.stdout
    log("dry run:\n" + dry.stdout[:1500])
    # No --nstages / --chunk_size: AutoConfig decides at launch and again after the morph.
    m = manager("autoconfig", steps=400, stages=None, chunk=None,
                extra_args=["--profile", str(profile), "--schedules", "all"]).start()
    m.wait_step(20)
    assert len(m.events("autoconfig")) == 1
    # Preempt a host the chosen plan uses (on this tiny model AutoConfig may
    # well choose one worker: preempting the other host would change nothing).
    first_hosts = m.events("launch")[0]["plan"]["hosts"]
    r = m.notify_preempt(first_hosts[0])
    assert r.returncode == 0, r.stderr
    assert m.wait_exit() == 0, m.tail()
    choices = m.events("autoconfig")
    assert len(choices) == 2, choices
    launches = m.events("launch")
    assert len(launches) == 2
    assert first_hosts[0] not in launches[1]["plan"]["hosts"], launches[1]
    assert launches[1]["plan"]["stages"] * launches[1]["plan"]["replicas"] <= 2  # the other host's 2 slots
    log("AutoConfig chose %s, then %s after the morph" % (choices[0]["chosen"], choices[1]["chosen"]))
    assert "AutoConfig" in m.output()
    assert_nothing_left(m.job)

    # A stale profile (the model changed since: here one piece's parameter
    # count) is refused by the workers at start-up; the job stops (exit 2).
    stale = json.loads(profile.read_text())
    stale["pieces"][1]["param_count"] += 1
    stale_path = ROOT / "stale-profile.json"
    stale_path.write_text(json.dumps(stale))
    m = manager("autoconfig-stale", steps=50, stages=None, chunk=None, extra_args=["--profile", str(stale_path)])
    m.start()
    assert m.wait_exit(120) == 2, m.tail()
    name = stale["pieces"][1]["name"]
    assert "piece '%s' has" % name in m.output() and "profile it again" in m.output(), m.tail()
    assert_nothing_left(m.job)


def test_python_profiler_then_autoconfig_trains_the_cutpoint_example():
    """varuna.Profiler (from Python) profiles the CutPoint example
    (examples/python/train_gpt2_cutpoints.py --profile, 2 processes); then
    run_varuna --profile without --nstages / --chunk_size has AutoConfig
    choose the plan from that file, and the Python workers (which check the
    profile's pieces against their own model) train it to the end."""
    python = os.environ.get("VARUNA_PYTHON", str(SOURCE / ".venv" / "bin" / "python"))
    script = str(SOURCE / "examples" / "python" / "train_gpt2_cutpoints.py")
    out = ROOT / "python-profile"
    r = subprocess.run([python, str(SOURCE / "scripts" / "varuna_launch.py"), "--nstages", "2", "--chunk_size", "1",
                        "--batch_size", "1", "--", python, script, "--profile", str(out),
                        "--micro_batch_sizes", "1,2,4", "--repetitions", "4", *TINY_MODEL],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    profile = json.loads((out / "profile.json").read_text())
    assert [p["name"] for p in profile["pieces"]] == ["piece0", "piece1", "piece2", "piece3"], profile["pieces"]
    steps = 30
    m = manager("python-autoconfig", steps=steps, stages=None, chunk=None, program=[python, script],
                extra_args=["--profile", str(out / "profile.json")]).start()
    assert m.wait_exit() == 0, m.tail()
    choices, launches = m.events("autoconfig"), m.events("launch")
    assert len(choices) == 1 and len(launches) == 1, (choices, launches)
    plan = launches[0]["plan"]
    chosen = "%dx%d m=%d " % (plan["stages"], plan["replicas"], plan["chunk_size"])
    assert choices[0]["chosen"].startswith(chosen), (choices[0]["chosen"], plan)
    log("AutoConfig chose %s for the Python profile" % choices[0]["chosen"])
    assert "AutoConfig" in m.output(), m.tail()
    # The workers ran that plan: rank 0's log (kept by its agent) has the one it built.
    rank0 = [p["host"] for p in plan["placement"] if p["rank"] == 0][0]
    worker_log = (m.connection_file(rank0).parent / "logs" / "g1_rank0.log").read_text(errors="replace")
    built = "plan: %d stages x %d replicas, schedule %s, precision fp32, micro-batch %d;" % (
        plan["stages"], plan["replicas"], choices[0]["chosen"].split()[-1], plan["chunk_size"])
    assert built in worker_log, (built, worker_log[-2000:])
    losses = m.losses()
    assert sorted(losses) == list(range(steps)), sorted(losses)
    assert all(math.isfinite(v) for v in losses.values()), losses
    first, last = sum(losses[s] for s in range(5)) / 5, sum(losses[s] for s in range(steps - 5, steps)) / 5
    log("losses: first five %.4f, last five %.4f" % (first, last))
    assert last < 0.9 * first, (first, last)
    assert_nothing_left(m.job)


def test_bad_inputs_are_clear_errors():
    m = manager("missing-program", program="./no_such_trainer")
    m.start()
    assert m.wait_exit(60) == 2
    assert "no_such_trainer does not exist" in m.output(), m.tail()
    assert_nothing_left(m.job)

    m = manager("bad-token", steps=100000).start()
    m.wait_step(5)
    # The job token is on no process's command line (ps shows those to everyone).
    token = (m.state_dir / "token").read_text().strip()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert token not in cmdline.read_bytes().decode(errors="replace"), cmdline
        except (FileNotFoundError, ProcessLookupError):
            pass
    conn = json.loads(m.connection_file("127.0.0.1").read_text())
    bad = m.workdir / "bad-token"
    bad.write_text("0" * 48 + "\n")
    r = subprocess.run([str(BIN / "notify_manager_preempt"), "--manager", conn["manager"], "--token_file", str(bad),
                        "--host", "127.0.0.1"], capture_output=True, text=True, timeout=30)
    # Refused in the TLS handshake: the manager derives another key for that identity.
    assert r.returncode != 0 and "did not accept this credential" in r.stderr, (r.returncode, r.stderr)
    # A host's notifier certificate (its connection file) speaks for that host only.
    r = m.notify_preempt("127.0.0.1", "--host", "10.9.9.9")
    assert r.returncode != 0 and "authenticated as notifier of '127.0.0.1'" in r.stderr, r.stderr
    # The operator's (the job's secret) may name any host, but one the job does not list is refused.
    r = subprocess.run([str(BIN / "notify_manager_preempt"), "--manager", conn["manager"], "--token_file",
                        str(m.state_dir / "token"), "--host", "10.9.9.9"], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "not in the machine list" in r.stderr, r.stderr
    status = subprocess.run([str(BIN / "run_varuna"), "status", "--state_dir", str(m.state_dir)],
                            capture_output=True, text=True, timeout=30)
    assert status.returncode == 0 and "2 stages x 2 replicas" in status.stdout, status.stdout
    log("status:\n" + status.stdout)
    m.kill(signal.SIGTERM)
    assert m.wait_exit() == 0
    assert_nothing_left(m.job)

    # Another job pointed at this job's state folder, or at its checkpoints, is
    # refused (it would resume weights that are not its own).
    other = Manager(m.workdir, TWO_HOSTS, job="e2e-other-" + str(os.getpid())).start()
    assert other.wait_exit(60) == 2
    assert "holds the state of job '%s'" % m.job in other.output().replace('"', "'"), other.tail()
    other = Manager(m.workdir, TWO_HOSTS, job="e2e-other-" + str(os.getpid()), state_dir=m.workdir / "state2").start()
    assert other.wait_exit(60) == 2
    assert "holds the checkpoints of job '%s'" % m.job in other.output(), other.tail()

    r = subprocess.run([str(BIN / "run_varuna"), "--machine_list", str(ROOT / "nope.txt"), "--nstages", "2",
                        "--batch_size", "8", "--chunk_size", "2", "--global_store", str(ROOT / "s"), "--", "./x"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "nope.txt does not exist" in r.stderr, r.stderr


class Prometheus:
    """A real Prometheus (Debian's package) on 127.0.0.1, scraping `targets`
    every second, its storage in `workdir`. The port is its own choice
    (--web.listen-address=127.0.0.1:0), read back from its log."""

    def __init__(self, workdir, targets):
        self.binary = shutil.which("prometheus")
        assert self.binary, "prometheus is not installed: run scripts/setup.sh (it installs Debian's prometheus)"
        self.workdir = Path(workdir)
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True)
        config = self.workdir / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                          "scrape_configs:\n  - job_name: varuna\n    static_configs:\n"
                          "      - targets: [%s]\n" % ", ".join("'%s'" % t for t in targets))
        self.log_path = self.workdir / "prometheus.log"
        self.argv = [self.binary, "--config.file=%s" % config, "--storage.tsdb.path=%s" % (self.workdir / "data"),
                     "--web.listen-address=127.0.0.1:0", "--log.level=info"]
        self.proc = None
        self.url = None

    def start(self, timeout=60):
        log("prometheus", " ".join(self.argv[1:]))
        self.out = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=self.out, stderr=subprocess.STDOUT)

        def listening():
            if self.proc.poll() is not None:
                raise AssertionError("prometheus exited with %s:\n%s" % (self.proc.returncode, self.tail()))
            for line in self.log_path.read_text(errors="replace").splitlines():
                if 'msg="Listening on"' in line and "address=" in line:
                    return line.split("address=")[1].split()[0]
            return None
        self.url = "http://" + wait_for("prometheus listening", listening, timeout)
        wait_for("prometheus ready (%s/-/ready)" % self.url, lambda: self._get("/-/ready") is not None, timeout)
        return self

    def _get(self, path):
        import urllib.error
        import urllib.request
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.read().decode()
        except (urllib.error.URLError, OSError):
            return None

    def query(self, expr):
        """The instant vector of `expr` now: [(labels, value), ...]."""
        import urllib.parse
        body = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert body is not None, "prometheus did not answer %s" % expr
        answer = json.loads(body)
        assert answer["status"] == "success", answer
        return [(r["metric"], float(r["value"][1])) for r in answer["data"]["result"]]

    def value(self, expr):
        """The one value of `expr` now, or None when it has none."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return result[0][1] if result else None

    def samples(self, series, seconds):
        """The samples scraped of one series over the last `seconds`: [(unix time, value), ...]."""
        import urllib.parse
        body = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": "%s[%ds]" % (series, seconds)}))
        answer = json.loads(body)
        assert answer["status"] == "success" and len(answer["data"]["result"]) == 1, answer
        return [(float(t), float(v)) for t, v in answer["data"]["result"][0]["values"]]

    def tail(self, lines=20):
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_prometheus_scrapes_the_metrics_through_a_preemption_morph():
    """The preemption job above with --metrics_port 0, scraped every second by
    a real Prometheus: through its API, the morph is counted with its cause,
    the plan is seen changing from 2x2 to 2x1 (and the generation from 1 to
    2), the step only grows, the preempted host is counted as such and no
    failure is counted."""
    m = manager("metrics", steps=100000, extra_args=["--manager_ip", "127.0.0.1", "--metrics_port", "0"]).start()
    address = wait_for("the metrics address in state.json", lambda: m.state().get("metrics_address"), 60)
    assert address.startswith("127.0.0.1:") and not address.endswith(":0"), address
    prometheus = Prometheus(ROOT / "metrics-prometheus", [address])
    try:
        prometheus.start()
        started = time.time()
        wait_for("the target up in prometheus",
                 lambda: prometheus.value('up{job="varuna"}') == 1 or m._died(), 60)

        def scrapes():
            return prometheus.value("count_over_time(varuna_generation[10m])") or 0
        # A few scrapes of the 2x2 job (the tiny model trains ~100 steps a second).
        wait_for("prometheus scraped the 2x2 plan 5 times (output:\n%s)" % m.tail(),
                 lambda: (scrapes() >= 5 and prometheus.value("varuna_plan_replicas") == 2
                          and (prometheus.value("varuna_step") or 0) >= 20) or m._died(), 120)
        before = scrapes()
        r = m.notify_preempt("127.0.0.2", "--in_seconds", "120")
        assert r.returncode == 0, r.stderr
        m.wait_event("morph_complete", timeout=120)
        morph = m.events("morph_complete")[0]
        launches = m.events("launch")
        resume = launches[1]["resume_step"]
        wait_for("prometheus scraped the morph and 5 more times (output:\n%s)" % m.tail(),
                 lambda: (prometheus.value('varuna_morphs_total{cause="preemption"}') == 1
                          and prometheus.value("varuna_plan_replicas") == 1
                          and (prometheus.value("varuna_step") or 0) >= resume + 20
                          and scrapes() >= before + 5) or m._died(), 120)
        seconds = int(time.time() - started) + 5
        window = "[%ds]" % seconds
        assert prometheus.value("max_over_time(varuna_plan_replicas%s)" % window) == 2
        assert prometheus.value("min_over_time(varuna_plan_replicas%s)" % window) == 1
        assert prometheus.value("varuna_plan_stages") == 2
        assert prometheus.value("min_over_time(varuna_generation%s)" % window) == 1
        assert prometheus.value("varuna_generation") == 2
        assert prometheus.value("sum(varuna_morphs_total)") == 1
        assert prometheus.value("varuna_morph_recovery_seconds_count") == 1
        recovery = prometheus.value("varuna_last_morph_recovery_seconds")
        assert abs(recovery - morph["total_s"]) < 1e-3, (recovery, morph)
        assert prometheus.value('varuna_hosts{state="preempted"}') == 1
        assert prometheus.value('varuna_hosts{state="up"}') == 1
        assert prometheus.value("sum(varuna_failures_total)") == 0
        assert prometheus.value('varuna_checkpoint_duration_seconds_count{kind="on_demand"}') == 1
        assert prometheus.value("varuna_last_checkpoint_step") >= resume
        steps = prometheus.samples("varuna_step", seconds)
        values = [v for _, v in steps if v >= 0]
        assert len(values) >= 10 and values[-1] > values[0], steps
        assert all(b >= a for a, b in zip(values, values[1:])), "the step went back: %s" % values
        assert (prometheus.value("varuna_goodput_samples_per_second") or 0) > 0
        log("prometheus: %d step samples %d..%d, recovery %.2f s, %d series of varuna_*"
            % (len(values), values[0], values[-1], recovery, len(prometheus.query('{__name__=~"varuna_.*"}'))))
        m.kill(signal.SIGTERM)
        assert m.wait_exit() == 0, m.tail()
    finally:
        prometheus.stop()
    assert prometheus.proc.returncode is not None
    assert_nothing_left(m.job)


def test_a_bad_metrics_or_control_port_is_a_clear_error():
    """Out of range: refused before anything starts. In use: run_varuna exits
    at start-up (code 2) naming --metrics_port and the fix, with no agent
    left behind; a control port in use exits 69 (retryable)."""
    m = manager("metrics-range", extra_args=["--metrics_port", "70000"]).start()
    assert m.wait_exit(60) == 2
    assert "--metrics_port must be 0..65535" in m.output(), m.tail()
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        m = manager("metrics-in-use", extra_args=["--manager_ip", "127.0.0.1", "--metrics_port", str(port)]).start()
        assert m.wait_exit(60) == 2
    out = m.output()
    assert "--metrics_port %d: cannot serve metrics on 127.0.0.1:%d" % (port, port) in out, m.tail()
    assert "Pick a free --metrics_port, or 0 for any free port" in out, m.tail()
    assert not m.events("launch"), m.events()
    assert_nothing_left(m.job)
    # The control port in use is worth a retry (the previous run_varuna may
    # still be exiting): its own exit code, 69, which systemd restarts.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        m = manager("control-in-use", extra_args=["--manager_ip", "127.0.0.1", "--port", str(port)]).start()
        assert m.wait_exit(60) == 69, m.tail()
    assert "cannot listen on 127.0.0.1:%d" % port in m.output(), m.tail()
    assert "retry" in m.output(), m.tail()
    assert not m.events("launch"), m.events()
    assert_nothing_left(m.job)


def png_size(path):
    """(width, height) of a PNG, from its IHDR chunk."""
    import struct
    data = Path(path).read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data
    return struct.unpack(">II", data[16:24])


def test_report_draws_the_timeline_of_a_preemption():
    """scripts/varuna_report.py on the state folder of the preemption job:
    steps.jsonl holds both generations (their first and last steps exactly),
    the timeline has the two plans as bands and the notice, the morph and
    the checkpoints on its time axis, and the PNG has a sane size."""
    m = manager("report", steps=160, train_args=["--checkpoint_every", "50"]).start()
    m.wait_step(30)
    r = m.notify_preempt("127.0.0.2", "--in_seconds", "120")
    assert r.returncode == 0, r.stderr
    assert m.wait_exit() == 0, m.tail()
    assert_nothing_left(m.job)
    steps = [json.loads(line) for line in (m.state_dir / "steps.jsonl").read_text().splitlines()]
    resume = m.events("launch")[1]["resume_step"]
    assert [s["generation"] for s in steps if s["step"] <= resume] and steps[-1]["step"] == 160, steps
    first_of_2 = [s for s in steps if s["generation"] == 2][0]
    assert first_of_2["step"] == resume + 1, (resume, first_of_2)
    assert all(s["step"] <= resume for s in steps if s["generation"] == 1), steps

    sys.path.insert(0, str(SOURCE / "scripts"))
    import varuna_report
    timeline = varuna_report.build_timeline(m.events(), steps)
    bands = [(g["stages"], g["replicas"]) for g in timeline["generations"]]
    assert bands == [(2, 2), (2, 1)], timeline["generations"]
    kinds = [mark["kind"] for mark in timeline["marks"]]
    assert "notice" in kinds and "morph" in kinds and "checkpoint" in kinds, kinds
    assert "loss" not in kinds and not timeline["rollbacks"], timeline  # a preemption loses nothing
    notice = [mark for mark in timeline["marks"] if mark["kind"] == "notice"][0]
    morph = timeline["morphs"][0]
    g2 = timeline["generations"][1]
    assert timeline["generations"][0]["start"] < notice["t"] <= morph["start"] + 0.01 < g2["start"] < morph["end"], \
        (notice, morph, g2)

    python = os.environ.get("VARUNA_PYTHON", str(SOURCE / ".venv" / "bin" / "python"))
    out = ROOT / "report" / "timeline.png"
    r = subprocess.run([python, str(SOURCE / "scripts" / "varuna_report.py"), "--state_dir", str(m.state_dir),
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == str(out), r.stdout
    width, height = png_size(out)
    size = out.stat().st_size
    log("report: %s, %dx%d, %d bytes" % (out, width, height, size))
    assert 800 <= width <= 4000 and 500 <= height <= 3000, (width, height)
    assert 20_000 <= size <= 5_000_000, size


if __name__ == "__main__":
    run_tests([
        test_preemption_morphs_2x2_to_2x1_and_resumes_exactly,
        test_python_trainer_morphs_and_resumes_exactly,
        test_worker_killed_relaunches_from_latest_checkpoint,
        test_sigstop_worker_is_detected_by_heartbeat_timeout,
        test_every_process_of_a_host_killed,
        test_host_added_to_machine_list_grows_the_job,
        test_preempted_host_comes_back_when_the_list_is_written_again,
        test_an_agents_sigterm_is_a_preemption_notice_each_time_the_host_comes_back,
        test_sigterm_checkpoints_and_stops,
        test_head_node_agents_and_workers_run_as_the_jobs_user,
        test_no_morphing_stops_on_the_first_failure,
        test_autoconfig_plans_from_a_profile_and_replans_after_a_morph,
        test_python_profiler_then_autoconfig_trains_the_cutpoint_example,
        test_bad_inputs_are_clear_errors,
        test_a_bad_metrics_or_control_port_is_a_clear_error,
        test_prometheus_scrapes_the_metrics_through_a_preemption_morph,
        test_report_draws_the_timeline_of_a_preemption,
    ])
