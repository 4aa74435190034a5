#!/usr/bin/env python3
"""Chaos: one job over SSH on three netns hosts (netns_cluster.py, real sshd
on each), and a seeded random series of faults of every kind, one every few
seconds once the job has recovered from the one before:

  host_kill        the VM gone (link down, every process SIGKILLed); booted
                   again with the same address at the next fault
  worker_sigkill   kill -9 of a worker
  worker_sigstop   a worker frozen (its heartbeats stop)
  agent_sigkill    kill -9 of an agent (its workers die with it)
  agent_sigstop    an agent frozen; thawed at the next fault
  job_sigkill      every worker of the job killed at once (an OOM sweep, a
                   bad driver), a few steps past a checkpoint: no survivor
                   holds the last step, so the job must resume from the
                   checkpoint and train those steps again
  preempt          a preemption notice from the host (8 s deadline)
  link_cut         the host's link down for 2-6 s, then up
  manager_restart  run_varuna killed (-9) and started again with the same
                   state folder and port, as systemd would

Asserts: after every fault the job trains new steps (in a generation launched
after the fault, or, for a link cut too short to be noticed, in the same one);
every host is back in the end (lost hosts are retried, preempted ones return
after their notice's deadline); no two generations' workers are alive
together longer than a superseded process may live (docs/run_varuna.md:
heartbeat timeout + agent grace + 2 s; processes sampled every 0.2 s, a
worker's generation read from its environment); no process is left; and
every step trained more than once has the same loss each time, and the
steps a job_sigkill took back were trained again (so that comparison always
has something to compare: salvage from survivors otherwise often leaves
nothing to retrain). With fewer than 9 faults a series may have no
job_sigkill; its losses are then compared wherever steps repeated, and the
log says how many did.

    chaos_test.py [--faults N] [--seed S]

N defaults to 12 (CI; every kind at least once from 9); the seed is printed, so a failing series can be run
again. Root only (network namespaces, sshd).
"""
import argparse
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_faults_common import (  # noqa: E402
    HEARTBEAT_TIMEOUT_S, SLACK_S, SUPERSEDED_BOUND_S, JobSampler, assert_repeated_steps_agree, job_processes_on,
    launches_since, notify_preempt_from, rank0_steps, set_link, ssh_manager, stop_and_check_clean,
    workers_of_job)
from netns_cluster import Cluster  # noqa: E402
from varuna_e2e import log, run_tests, wait_for  # noqa: E402

KINDS = ["host_kill", "worker_sigkill", "worker_sigstop", "agent_sigkill", "agent_sigstop", "preempt", "link_cut",
         "manager_restart", "job_sigkill"]
HOST_LEVEL = {"host_kill", "agent_sigkill", "agent_sigstop", "preempt", "link_cut"}
N_HOSTS = 3
RECOVERY_TIMEOUT_S = 150   # a lost host's backoff, an SSH timeout, a relaunch on a loaded machine
NEW_STEPS = 5              # "recovered": rank 0 of a generation launched after the fault logged this many steps
PREEMPT_NOTICE_S = 8
CHECKPOINT_EVERY = 10      # train_gpt --checkpoint_every

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--faults", type=int, default=12, help="how many faults (default 12)")
parser.add_argument("--seed", type=int, default=None, help="seed of the series (default: from the clock)")
parser.add_argument("--gap_s", type=float, nargs=2, default=(1.0, 4.0), metavar=("MIN", "MAX"),
                    help="pause between a recovery and the next fault (default 1 4)")
ARGS = parser.parse_args()
sys.argv = sys.argv[:1]  # run_tests reads test names from argv
SEED = ARGS.seed if ARGS.seed is not None else int(time.time() * 1000) % 1_000_000

if os.geteuid() != 0:
    print("skipped: network namespaces and sshd need root")
    sys.exit(77)

ROOT = Path(os.environ.get("VARUNA_TEST_TMPDIR", tempfile.mkdtemp(prefix="varuna-chaos-")))
shutil.rmtree(ROOT, ignore_errors=True)
ROOT.mkdir(parents=True, exist_ok=True)


class Chaos:
    """Drives the faults; remembers what it has to undo (a killed host to boot,
    a frozen agent to thaw) and which hosts are impaired until then."""

    def __init__(self, cluster, m, rng):
        self.c, self.m, self.rng = cluster, m, rng
        self.by_addr = {h.addr: h for h in cluster.hosts}
        self.killed = []         # hosts to restart
        self.frozen = []         # (host, agent pid) to thaw
        self.preempted = {}      # addr -> time its notice's deadline passes
        self.port = None
        self.done = []           # one record per fault

    # -------------------------------------------------------------- state

    def current_generation(self):
        launches = self.m.events("launch")
        return launches[-1]["generation"] if launches else None

    def plan_hosts(self):
        launches = self.m.events("launch")
        return list(launches[-1]["plan"]["hosts"]) if launches else []

    def impaired(self):
        now = time.time()
        out = {h.addr for h in self.killed} | {h.addr for h, _ in self.frozen}
        return out | {a for a, until in self.preempted.items() if until > now}

    def healthy_up(self):
        hosts = self.m.state().get("hosts", {})
        return [a for a, s in hosts.items() if s.get("agent") == "up" and a not in self.impaired()]

    def wait_steady(self):
        """The newest generation trains: its rank 0 has logged 3 steps."""
        def steady():
            gen = self.current_generation()
            self.m._died()  # noqa: SLF001
            return gen is not None and len(rank0_steps(self.m.job, gen)) >= 3 and gen
        return wait_for("the job training (manager output:\n%s)" % self.m.tail(), steady, RECOVERY_TIMEOUT_S, 0.1)

    # ------------------------------------------------------------ restore

    def restore(self):
        for host in self.killed:
            log("restore: booting %s again" % host.addr)
            self.c.restart_host(host)
        self.killed = []
        for host, pid in self.frozen:
            log("restore: thawing the agent %d on %s" % (pid, host.addr))
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.frozen = []

    # ------------------------------------------------------------- faults

    def feasible(self, kind):
        if kind in HOST_LEVEL:
            # Never leave the job without a host: one impaired at a time, and
            # the target must be one the current plan uses.
            return len(self.healthy_up()) >= 2 and any(a not in self.impaired() for a in self.plan_hosts())
        if kind in ("worker_sigkill", "worker_sigstop", "job_sigkill"):
            gen = self.current_generation()
            return any(g == gen for _, g, _, _ in workers_of_job(self.m.job))
        return True

    def target_host(self):
        candidates = [a for a in self.plan_hosts() if a not in self.impaired()]
        return self.by_addr[self.rng.choice(sorted(candidates))]

    def inject(self, kind):
        """Injects one fault; returns (target description, extra record fields)."""
        m, c = self.m, self.c
        if kind in ("worker_sigkill", "worker_sigstop"):
            gen = self.current_generation()
            pid, _, host, rank = self.rng.choice(sorted(w for w in workers_of_job(m.job) if w[1] == gen))
            os.kill(pid, signal.SIGKILL if kind == "worker_sigkill" else signal.SIGSTOP)
            return "rank %d (pid %d) on %s, generation %d" % (rank, pid, host, gen), {}
        if kind == "job_sigkill":
            return self.kill_job_past_checkpoint()
        if kind == "manager_restart":
            m.kill(signal.SIGKILL)
            m.proc.wait()
            time.sleep(self.rng.uniform(0.2, 2.0))  # systemd's restart delay
            m.start()
            return "run_varuna (port %s)" % self.port, {}
        host = self.target_host()
        if kind == "host_kill":
            c.kill_host(host)
            self.killed.append(host)
        elif kind in ("agent_sigkill", "agent_sigstop"):
            agents = job_processes_on(c, host, m.job)["agent"]
            assert agents, "no agent on %s: %s" % (host.addr, m.tail())
            os.kill(agents[0], signal.SIGKILL if kind == "agent_sigkill" else signal.SIGSTOP)
            if kind == "agent_sigstop":
                self.frozen.append((host, agents[0]))
        elif kind == "preempt":
            r = notify_preempt_from(c, m, host, "--in_seconds", str(PREEMPT_NOTICE_S))
            assert r.returncode == 0, "notify_manager_preempt on %s: %s %s" % (host.addr, r.stdout, r.stderr)
            self.preempted[host.addr] = time.time() + PREEMPT_NOTICE_S
        elif kind == "link_cut":
            hold = self.rng.uniform(2.0, 6.0)
            set_link(c, host, up=False)
            try:
                time.sleep(hold)  # the fault itself: the partition lasts `hold` s
            finally:
                set_link(c, host, up=True)
            return host.addr, {"cut_s": round(hold, 1), "healed": time.time()}
        return host.addr, {}

    def kill_job_past_checkpoint(self):
        """SIGKILLs every worker of the current generation once its rank 0 has
        logged a step 3 to 7 past a checkpoint: the steps from the checkpoint
        to there are lost with every copy of the state, and must be trained
        again. Returns what inject does, the lost steps in the record."""
        gen = self.current_generation()

        def past_checkpoint():
            steps = rank0_steps(self.m.job, gen)
            return steps and 3 <= steps[-1][0] % CHECKPOINT_EVERY <= 7 and steps[-1][0]
        last = wait_for("rank 0 of generation %d a few steps past a checkpoint" % gen, past_checkpoint,
                        RECOVERY_TIMEOUT_S, 0.02)
        workers = sorted(w for w in workers_of_job(self.m.job) if w[1] == gen)
        for pid, _, _, _ in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # gone already (a generation ending by itself): dead either way
        checkpoint = last - last % CHECKPOINT_EVERY
        return ("%d workers of generation %d at step %d" % (len(workers), gen, last),
                {"lost_steps": list(range(checkpoint + 1, last + 1))})

    def wait_recovered(self, record):
        """Until rank 0 of a generation launched after the fault has logged
        NEW_STEPS steps; for a link cut that nobody noticed (no launch within
        heartbeat timeout + 2 s of the healing), until the generation that
        ran at the fault has logged NEW_STEPS more."""
        m, t_fault = self.m, record["time"]

        def recovered():
            m._died()  # noqa: SLF001
            after = launches_since(m, t_fault)
            if after:
                gen = after[-1]["generation"]
                if len(rank0_steps(m.job, gen)) >= NEW_STEPS:
                    return gen
                return None
            if record["kind"] == "link_cut" and time.time() > record["healed"] + HEARTBEAT_TIMEOUT_S + 2:
                gen = record["generation"]
                if len(rank0_steps(m.job, gen)) >= record["steps_before"] + NEW_STEPS:
                    return gen
            return None
        gen = wait_for("recovery from fault %d (%s on %s) (manager output:\n%s)"
                       % (record["n"], record["kind"], record["target"], m.tail()), recovered, RECOVERY_TIMEOUT_S, 0.1)
        record["recovered_s"] = round(time.time() - t_fault, 1)
        record["new_generation"] = gen

    def run(self, n_faults, gap):
        queue = list(KINDS)
        self.rng.shuffle(queue)  # every kind once (when N >= 9), then at random
        queue += [self.rng.choice(KINDS) for _ in range(max(0, n_faults - len(queue)))]
        queue = queue[:n_faults]
        for n in range(1, n_faults + 1):
            self.restore()
            gen = self.wait_steady()
            kind = next((k for k in queue if self.feasible(k)), None)
            if kind is None:
                # Only host-level kinds left and a host still impaired
                # (a preemption's deadline): its rejoining comes first.
                wait_for("a host-level fault possible (hosts %s, impaired %s)" % (self.m.state().get("hosts"),
                                                                                  self.impaired()),
                         lambda: any(self.feasible(k) for k in queue), RECOVERY_TIMEOUT_S, 0.2)
                gen = self.wait_steady()
                kind = next(k for k in queue if self.feasible(k))
            queue.remove(kind)
            record = {"n": n, "kind": kind, "generation": gen, "steps_before": len(rank0_steps(self.m.job, gen)),
                      "time": time.time()}
            target, extra = self.inject(kind)
            record.update(target=target, **extra)
            log("fault %d/%d: %s on %s" % (n, n_faults, kind, target))
            self.wait_recovered(record)
            log("fault %d recovered in %.1f s: generation %s trains" % (n, record["recovered_s"], record["new_generation"]))
            self.done.append(record)
            time.sleep(self.rng.uniform(*gap))  # the schedule: the next fault comes a few seconds later


def test_chaos():
    rng = random.Random(SEED)
    log("chaos: seed %d, %d faults (run again with --seed %d --faults %d)" % (SEED, ARGS.faults, SEED, ARGS.faults))
    started = time.monotonic()
    with Cluster(N_HOSTS, str(ROOT / "cluster")) as c:
        m = ssh_manager(c, ROOT, "chaos", ["%s slots=2" % h.addr for h in c.hosts], steps=10_000_000,
                        extra_args=["--max_failures", "1000", "--failure_window_s", "30"],
                        train_args=["--checkpoint_every", str(CHECKPOINT_EVERY)])
        m.start()
        sampler = JobSampler(m.job)
        sampler.start()
        chaos = Chaos(c, m, rng)
        try:
            # The port is chosen at the first start (port 0) and kept for the
            # restarts, as a systemd unit's fixed --port would be.
            address = wait_for("state.json naming the address", lambda: m.state().get("address"), 60)
            chaos.port = address.rsplit(":", 1)[1]
            m.argv[m.argv.index("--port") + 1] = chaos.port
            chaos.wait_steady()
            chaos.run(ARGS.faults, ARGS.gap_s)
            chaos.restore()
            # Every host back: lost ones retried, preempted ones past their deadline.
            wait_for("every host's agent up (hosts: %s)" % m.state().get("hosts"),
                     lambda: m._died() or all(s.get("agent") == "up" and not s.get("preempted")  # noqa: SLF001
                                              for s in m.state().get("hosts", {}).values())
                     and len(m.state().get("hosts", {})) == N_HOSTS, RECOVERY_TIMEOUT_S)
            chaos.wait_steady()
            stop_and_check_clean(c, m)
        finally:
            chaos.restore()
            sampler.stop()
        log("faults:")
        for r in chaos.done:
            log("  %2d %-16s %-45s recovered in %5.1f s -> generation %s%s" % (
                r["n"], r["kind"], r["target"], r["recovered_s"], r["new_generation"],
                " (cut %.1f s)" % r["cut_s"] if "cut_s" in r else ""))
        if ARGS.faults >= len(KINDS):
            assert {r["kind"] for r in chaos.done} == set(KINDS), [r["kind"] for r in chaos.done]
        worst, pair, details = sampler.worst_overlap()
        log("process samples: %d; generations seen: %s; longest two generations alive together: %.1f s %s %s "
            "(bound %.1f s + %.1f s)" % (sampler.samples, sorted(sampler.generations), worst, pair or "", details or "",
                                         SUPERSEDED_BOUND_S, SLACK_S))
        for (old, new), (first, last, count, pids) in sorted(sampler.together.items()):
            log("  generations %d and %d together for %.1f s (%d samples; pids of %d: %s)"
                % (old, new, last - first + sampler.period, count, old, sorted(pids)))
        assert worst <= SUPERSEDED_BOUND_S + SLACK_S, (worst, pair, details)
        by_gen = sampler.losses_by_generation()
        repeated, _ = assert_repeated_steps_agree(m.job, m.events("launch"), by_gen)
        for r in chaos.done:
            if r["kind"] == "job_sigkill":
                again = [s for s in r["lost_steps"] if s in repeated]
                assert again, "fault %d (%s) took back steps %s, and none was trained again" % (
                    r["n"], r["target"], r["lost_steps"])
        if "job_sigkill" not in {r["kind"] for r in chaos.done}:
            log("no job_sigkill in %d faults: %d steps trained twice by chance" % (len(chaos.done), len(repeated)))
    log("chaos: seed %d, %d faults, %.0f s" % (SEED, len(chaos.done), time.monotonic() - started))


if __name__ == "__main__":
    run_tests([test_chaos])
