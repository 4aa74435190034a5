"""Shared pieces of host_faults_test.py and chaos_test.py: run_varuna over SSH
on a netns cluster (netns_cluster.py), with the timeouts the fault tests use,
and the instruments that judge the outcome:

- JobSampler: every 0.2 s, which generations have live workers (what a
  worker is and its generation come from its environment: VARUNA_JOB,
  VARUNA_GENERATION), to measure how long two generations coexist;
- rank-0 losses per generation, read from the workers' logs
  (/tmp/varuna/JOB/HOST/logs/g<G>_rank0.log), to check that a step trained
  more than once gives the same loss each time.
"""
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from varuna_e2e import Manager, log, wait_for

# The timeouts of every fault test: short enough for faults to be seen in
# seconds, long enough for a loaded 2-core machine.
HEARTBEAT_TIMEOUT_S = 3
AGENT_GRACE_S = 2
# docs/run_varuna.md, "How long a superseded process can live": a worker that
# cannot hear the manager is gone at most heartbeat_timeout_s + agent_grace_s
# + 2 s after it last heard from it (an agent: heartbeat + grace).
SUPERSEDED_BOUND_S = HEARTBEAT_TIMEOUT_S + AGENT_GRACE_S + 2
# A worker ordered out over its own connection goes within 0.1 s of the order
# (the kill_all); generous for this machine.
ORDERED_EXIT_BOUND_S = 3.0
# Sampling period and scheduling noise allowed on top of a documented bound.
SLACK_S = 1.5

LOG_ROOT = Path("/tmp/varuna")


def ssh_manager(cluster, root, name, hosts, extra_args=(), **kw):
    """A Manager run in the head namespace that starts agents over SSH."""
    extra = ["--manager_ip", cluster.head_addr, "--ssh_identity", cluster.identity_file,
             "--ssh_known_hosts", cluster.known_hosts_file, "--ssh_connect_timeout_s", "3",
             "--heartbeat_timeout_s", str(HEARTBEAT_TIMEOUT_S), "--agent_grace_s", str(AGENT_GRACE_S),
             "--restart_backoff_s", "0.2", *extra_args]
    return Manager(Path(root) / name, hosts, job="%s-%d" % (name, os.getpid()), extra_args=extra,
                   prefix=["ip", "netns", "exec", cluster.head_ns], **kw)


def hosts_of(launch_event):
    return launch_event["plan"]["hosts"]


def launches_since(m, unix_s):
    return [e for e in m.events("launch") if e["unix_ms"] / 1000 >= unix_s]


# ------------------------------------------------------------------ processes

def _environ(pid):
    try:
        raw = Path("/proc/%d/environ" % pid).read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        if (item.startswith(b"VARUNA_") or item.startswith(b"RANK=")) and b"=" in item:
            k, v = item.split(b"=", 1)
            out[k.decode()] = v.decode(errors="replace")
    return out


def _cmdline(pid):
    try:
        return Path("/proc/%d/cmdline" % pid).read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def running(pid):
    """Alive and not a zombie (a frozen agent cannot reap its exited workers).
    A stopped (SIGSTOP) process counts: it can run again."""
    try:
        stat = Path("/proc/%d/stat" % pid).read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def job_processes_on(cluster, host, job):
    """{'agent': [pids], 'workers': [pids]} of `job` in the host's namespace."""
    out = {"agent": [], "workers": []}
    for pid in cluster.pids_in(host):
        if not running(pid):
            continue
        cmd = _cmdline(pid)
        if "varuna_agent" in cmd and ("--job " + job + " ") in cmd + " ":
            out["agent"].append(pid)
        elif "train_gpt" in cmd and _environ(pid).get("VARUNA_JOB") == job:
            out["workers"].append(pid)
    return out


def workers_of_job(job):
    """[(pid, generation, host, rank)] of the job's running workers on this machine."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        env = _environ(pid)
        if env.get("VARUNA_JOB") != job or "VARUNA_GENERATION" not in env or not running(pid):
            continue
        if "train_gpt" not in _cmdline(pid):
            continue  # between the agent's fork and exec
        found.append((pid, int(env["VARUNA_GENERATION"]), env.get("VARUNA_HOST"), int(env.get("RANK", "-1"))))
    return found


class JobSampler(threading.Thread):
    """Every `period` s, the generations of the job's running workers. For every
    pair of generations seen alive together, the first and last time they were
    (so a superseded generation's lifetime next to its successor is measured,
    whatever ended it). Every `loss_period` s it also copies what rank 0 of
    each generation has logged: an agent keeps only the last
    kKeptLogGenerations (10) generations' worker logs, and a long fault series
    passes that, so the steps an early generation trained again would be gone
    by the time the losses are compared."""

    def __init__(self, job, period=0.2, loss_period=1.0):
        super().__init__(daemon=True)
        self.job, self.period, self.loss_period = job, period, loss_period
        self.together = {}  # (older, newer) -> [first, last, sample count, pids of older]
        self.samples = 0
        self.generations = set()
        self.losses = {}  # generation -> [(step, loss)], the longest read of its rank-0 log
        self._sizes = {}  # path -> its size when last read: unchanged logs are not read again
        self._last_loss_read = 0.0
        self.done = threading.Event()

    def keep_losses(self):
        for path in LOG_ROOT.joinpath(self.job).glob("*/logs/g*_rank0.log"):
            try:
                size = path.stat().st_size
            except OSError:
                continue  # pruned meanwhile: what was read of it is kept
            if self._sizes.get(path) == size:
                continue
            self._sizes[path] = size
            gen = generation_of_rank0_log(path)
            records = rank0_steps_of(path)
            if len(records) >= len(self.losses.get(gen, ())):
                self.losses[gen] = records
        self._last_loss_read = time.monotonic()

    def losses_by_generation(self):
        """{generation: [(step, loss)]}: every generation's rank-0 steps, pruned logs included."""
        self.keep_losses()
        return dict(self.losses)

    def sample(self):
        now = time.time()
        by_gen = {}
        for pid, gen, host, rank in workers_of_job(self.job):
            by_gen.setdefault(gen, []).append((pid, host, rank))
        self.samples += 1
        self.generations |= set(by_gen)
        gens = sorted(by_gen)
        for i, old in enumerate(gens):
            for new in gens[i + 1:]:
                entry = self.together.setdefault((old, new), [now, now, 0, set()])
                entry[1] = now
                entry[2] += 1
                entry[3] |= {p for p, _, _ in by_gen[old]}

    def run(self):
        while not self.done.is_set():
            try:
                self.sample()
                if time.monotonic() - self._last_loss_read >= self.loss_period:
                    self.keep_losses()
            except Exception as e:  # noqa: BLE001 - a /proc race must not end the sampling
                log("sampler:", e)
            self.done.wait(self.period)

    def stop(self):
        self.done.set()
        self.join()

    def worst_overlap(self):
        """(seconds, (older, newer), details) of the longest coexistence, or (0, None, None)."""
        if not self.together:
            return 0.0, None, None
        pair, (first, last, n, pids) = max(self.together.items(), key=lambda kv: kv[1][1] - kv[1][0])
        return last - first + self.period, pair, {"samples": n, "older_pids": sorted(pids)}


# ----------------------------------------------------------------- network

def set_link(cluster, host, up):
    """Takes the host's only link (the veth end on the head's bridge) down or
    up: nothing passes either way, no FIN or RST, as in a network partition.
    (netns_cluster names that end `v<index>`; kill_host uses the same.)"""
    veth = cluster._veth(host)  # noqa: SLF001 - the harness's own name for the link
    r = subprocess.run(["ip", "-n", cluster.head_ns, "link", "set", veth, "up" if up else "down"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def notify_preempt_from(cluster, m, host, *extra):
    """The preemption hook run on the preempted host itself, as the pollers do."""
    from varuna_e2e import BIN
    return cluster.run_in(host, [str(BIN / "notify_manager_preempt"), "--connection_file",
                                 str(m.connection_file(host.addr)), *extra], timeout=30)


# ------------------------------------------------------------------- losses

_STEP_LINE = re.compile(r"^step (\d+) loss (\S+) grad_norm ")
_RANK0_LOG = re.compile(r"g(\d+)_rank0\.log$")  # an agent's log of rank 0 of a generation


def generation_of_rank0_log(path):
    """The generation whose rank-0 log `path` is."""
    return int(_RANK0_LOG.match(path.name).group(1))


def rank0_steps_of(path):
    """[(step, loss)] in one rank-0 log, in order ([] if it cannot be read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [(int(m.group(1)), float(m.group(2))) for m in map(_STEP_LINE.match, text.splitlines()) if m]


def rank0_steps(job, generation):
    """[(step, loss)] rank 0 of `generation` printed (train_gpt --log_every 1), in order."""
    out = []
    for path in LOG_ROOT.joinpath(job).glob("*/logs/g%d_rank0.log" % generation):
        out += rank0_steps_of(path)
    return out


def losses_by_generation(job):
    """{generation: [(step, loss)]} from every rank-0 log of the job."""
    out = {}
    for path in LOG_ROOT.joinpath(job).glob("*/logs/g*_rank0.log"):
        gen = generation_of_rank0_log(path)
        out.setdefault(gen, [])
    for gen in out:
        out[gen] = rank0_steps(job, gen)
    return out


def assert_repeated_steps_agree(job, launches, by_gen=None):
    """Every step trained more than once (by a relaunch from a checkpoint, or a
    superseded generation that ran on for a moment) has the same loss each time.
    Two computations of a step may differ by float noise where the data-parallel
    width differed somewhere in their histories (gradients summed in another
    order), and the log prints 6 significant digits; a broken resume (a batch
    skipped or repeated, optimizer state lost) moves a loss by about the
    step-to-step spread. So, as local_job_test's preemption case: relative
    difference under min(1e-3, spread / 10). `by_gen`, {generation: [(step,
    loss)]}, where the logs were collected as they grew (JobSampler), else
    read now. Returns ({step: how many generations trained it} of the steps
    trained by more than one, worst)."""
    by_gen = losses_by_generation(job) if by_gen is None else by_gen
    width = {e["generation"]: (e["plan"]["stages"], e["plan"]["replicas"]) for e in launches}
    seen = {}  # step -> [(generation, loss)]
    for gen, records in sorted(by_gen.items()):
        for step, loss in records:
            seen.setdefault(step, []).append((gen, loss))
    assert seen, "no step was logged by any rank 0 of job %s" % job
    first = {s: v[0][1] for s, v in seen.items()}
    steps = sorted(first)
    jumps = sorted(abs(first[b] - first[a]) / max(abs(first[a]), 1e-6)
                   for a, b in zip(steps, steps[1:]) if b == a + 1)
    spread = jumps[len(jumps) // 2] if jumps else 1e-2
    bound = min(1e-3, spread / 10)
    worst, worst_at, repeated, exact = 0.0, None, {}, 0
    for step, values in sorted(seen.items()):
        if len(values) < 2:
            continue
        generations = len({gen for gen, _ in values})
        if generations >= 2:
            repeated[step] = generations
        ref = values[0][1]
        for gen, loss in values[1:]:
            diff = abs(loss - ref) / max(abs(ref), 1e-6)
            exact += diff == 0
            if diff > worst:
                worst, worst_at = diff, (step, values)
    log("losses: %d steps logged, %d trained more than once (%d repeats printed identically), worst relative "
        "difference %.2e (bound %.1e; median step-to-step change %.1e); generations and plans: %s"
        % (len(seen), len(repeated), exact, worst, bound, spread,
           {g: "%dx%d" % width[g] if g in width else "?" for g in sorted(by_gen)}))
    assert worst < bound, "step %s was trained with different losses: %s (generation, loss)" % worst_at
    return repeated, worst


def stop_and_check_clean(cluster, m, timeout=120):
    """SIGTERM to run_varuna (checkpoint, stop, code 0), then nothing of the job
    anywhere: no agent or worker on this machine, no process but the listening
    sshds in the cluster's namespaces."""
    from varuna_e2e import assert_nothing_left
    m.kill(signal.SIGTERM)
    code = m.wait_exit(timeout)
    assert code == 0, "run_varuna exited with %s:\n%s" % (code, m.tail())
    assert_nothing_left(m.job)
    left = cluster.leftover_processes()
    assert not left, "processes left on the hosts: %s" % left


def wait_generation_steps(m, generation, count, timeout):
    """Until rank 0 of `generation` has logged `count` steps; returns them."""
    return wait_for("%d steps of generation %d (manager output:\n%s)" % (count, generation, m.tail()),
                    lambda: (len(rank0_steps(m.job, generation)) >= count and rank0_steps(m.job, generation))
                    or m._died(), timeout)  # noqa: SLF001
