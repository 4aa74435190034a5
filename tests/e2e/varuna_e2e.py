"""Helpers for the end-to-end tests of run_varuna: start the manager on a job,
wait on its state file and event log (readiness by content, with deadlines),
and check that nothing is left behind.

The tests use the real binaries of the build tree (VARUNA_BUILD_DIR) and the
example trainer, train_gpt, with a model small enough for 2 cores.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

BUILD = Path(os.environ.get("VARUNA_BUILD_DIR", Path(__file__).resolve().parents[2] / "build"))
BIN = BUILD / "bin"
TRAIN_DIR = BUILD / "examples" / "gpt"

# A model that trains a step in a few tens of milliseconds on one core.
TINY_MODEL = ["--d_model", "32", "--layers", "2", "--heads", "2", "--seq_len", "16", "--threads", "1"]


def log(*parts):
    print("[e2e %s]" % time.strftime("%H:%M:%S"), *parts, flush=True)


def wait_for(what, predicate, timeout, interval=0.05):
    """Polls predicate() until it returns a true value; fails naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.0f s waiting for %s" % (timeout, what))
        time.sleep(interval)


def managers(root, first_port, job_prefix, machines=None):
    """A test file's way to make its Managers: each gets its own folder under
    `root`, a job name of this process's own, and the file's next master port
    (10 apart from the last; each file starts at its own `first_port`)."""
    port = [first_port]

    def make(name, machines=machines, **kw):
        port[0] += 10
        extra = list(kw.pop("extra_args", [])) + ["--master_port", str(port[0])]
        return Manager(root / name, machines, job="%s-%s-%d" % (job_prefix, name, os.getpid()), extra_args=extra, **kw)
    return make


class Manager:
    """One run_varuna process and its state folder."""

    def __init__(self, workdir, machines, stages=2, batch=16, chunk=4, steps=200, job="e2e",
                 extra_args=(), train_args=(), prefix=(), program="./train_gpt", code_dir=None,
                 state_dir=None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.job = job
        # machines None: no list, hosts join by themselves (--machine_source join).
        self.machine_list = self.workdir / "machines.txt" if machines is not None else None
        if machines is not None:
            self.write_machines(machines)
        source = ["--machine_list", str(self.machine_list)] if machines is not None else ["--machine_source", "join"]
        self.state_dir = Path(state_dir) if state_dir else self.workdir / "state"
        self.store = self.workdir / "store"
        self.dump = self.workdir / "dump"
        self.dump.mkdir(exist_ok=True)
        self.output_path = self.workdir / "manager.log"
        plan = (["--nstages", str(stages)] if stages else []) + (["--chunk_size", str(chunk)] if chunk else [])
        self.argv = [*prefix, str(BIN / "run_varuna"), "--job", job, *source,
                     "--batch_size", str(batch), *plan,
                     "--global_store", str(self.store), "--state_dir", str(self.state_dir),
                     "--code_dir", str(code_dir or TRAIN_DIR),
                     *([] if "--port" in extra_args else ["--port", "0"]), *extra_args, "--", *([program] if isinstance(program, str) else program),
                     "--steps", str(steps), *TINY_MODEL,
                     "--dump_dir", str(self.dump), *train_args]
        self.proc = None

    def write_machines(self, machines):
        tmp = self.machine_list.with_suffix(".tmp")
        tmp.write_text("".join(m + "\n" for m in machines))
        tmp.replace(self.machine_list)

    def start(self):
        log("run_varuna", " ".join(self.argv[:14]), "...")
        self.out = open(self.output_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=self.out, stderr=subprocess.STDOUT)
        _started.append(self)
        return self

    def state(self):
        try:
            return json.loads((self.state_dir / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def step(self):
        return self.state().get("progress", {}).get("step", -1)

    def events(self, name=None):
        path = self.state_dir / "events.jsonl"
        if not path.exists():
            return []
        out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [e for e in out if name is None or e["event"] == name]

    def output(self):
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""

    def wait_step(self, step, timeout=120):
        return wait_for("step %d (manager output:\n%s)" % (step, self.tail()),
                        lambda: self.step() >= step or self._died(), timeout)

    def wait_event(self, name, timeout=120, count=1):
        return wait_for("event %s (manager output:\n%s)" % (name, self.tail()),
                        lambda: len(self.events(name)) >= count or self._died(), timeout)

    def stop_once_trained_on(self, launches, steps=5, timeout=120):
        """For a job that must not end before a late event (a host coming back,
        a growth): it trains with far more steps than the test needs, so a fast
        machine cannot finish it first; once its `launches`-th launch trained
        `steps` steps, SIGTERM stops it (a checkpoint, then exit 0).
        Returns the exit code."""
        self.wait_event("launch", count=launches, timeout=timeout)
        generation = self.events("launch")[launches - 1]["generation"]
        resume = self.events("launch")[launches - 1].get("resume_step", 0)
        wait_for("generation %d trained %d steps (manager output:\n%s)" % (generation, steps, self.tail()),
                 lambda: (self.state().get("generation") == generation and self.step() >= resume + steps)
                 or self._died(), timeout)
        self.kill(signal.SIGTERM)
        return self.wait_exit()

    def _died(self):
        if self.proc.poll() is not None:
            raise AssertionError("run_varuna exited early with %s:\n%s" % (self.proc.returncode, self.tail()))
        return False

    def wait_exit(self, timeout=180):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("run_varuna still running after %d s:\n%s" % (timeout, self.tail()))

    def tail(self, lines=40):
        return "\n".join(self.output().splitlines()[-lines:])

    def address(self, timeout=30):
        """host:port agents dial, once the manager said where it listens."""
        started = wait_for("manager_started (manager output:\n%s)" % self.tail(),
                           lambda: self.events("manager_started") or self._died(), timeout)
        return started[0]["address"]

    def connection_file(self, host):
        return Path("/tmp/varuna") / self.job / host / "connection.json"

    def worker_log(self, host, generation, rank):
        """What a worker wrote to its stdout and stderr, as its host's agent keeps it."""
        return (Path("/tmp/varuna") / self.job / host / "logs" / ("g%d_rank%d.log" % (generation, rank))).read_text()

    def notify_preempt(self, host, *extra):
        argv = [str(BIN / "notify_manager_preempt"), "--connection_file", str(self.connection_file(host)), *extra]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    def kill(self, sig=signal.SIGKILL):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def losses(self, rank=0):
        """step -> loss from the trainer's per-step log (appended across morphs)."""
        path = self.dump / ("rank%d_steps.jsonl" % rank)
        out = {}
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out[record["step"]] = record["loss"]
        return out


def assert_losses_continue(got, want, steps):
    """The losses of a job that morphed (its data-parallel width changed) against
    those of an uninterrupted run: the same global batches, but the gradients
    are summed in another order (two replicas' partial sums vs one replica's
    running sum), last-bit differences that training amplifies over hundreds of
    steps (2e-5 to 2e-4 relative seen at 160-400 steps). What a broken resume
    does (a batch skipped or repeated, optimizer state lost) moves a loss by
    about the batch-to-batch spread, so the bound is a tenth of that spread and
    never more than 1e-3. Returns the worst relative difference."""
    assert sorted(got) == list(range(steps)), "missing steps: %s" % sorted(set(range(steps)) - set(got))
    worst = max(abs(got[s] - want[s]) / max(abs(want[s]), 1e-6) for s in range(steps))
    jumps = sorted(abs(want[s + 1] - want[s]) / max(abs(want[s]), 1e-6) for s in range(steps - 1))
    spread = jumps[len(jumps) // 2]
    bound = min(1e-3, spread / 10)
    log("max relative loss difference vs the uninterrupted run: %.2e (bound %.1e; median step-to-step change %.1e)"
        % (worst, bound, spread))
    assert worst < bound, (worst, bound)
    return worst


def assert_resumed_exactly(morphed, resumed, after_step):
    """The steps after `after_step` of the morphed job against a job of the
    same plan started from a copy of the same checkpoint: nothing may differ
    but float noise of the same kernels (relative 1e-6)."""
    steps = [s for s in sorted(resumed) if s > after_step]
    assert steps and all(s in morphed for s in steps), (after_step, sorted(resumed)[:5])
    worst = max(abs(morphed[s] - resumed[s]) / max(abs(resumed[s]), 1e-6) for s in steps)
    log("after the checkpoint of step %d: max relative difference %.1e over %d steps" % (after_step, worst, len(steps)))
    assert worst <= 1e-6, worst


def processes_of_job(job):
    """(pid, cmdline) of every agent and worker of `job` still alive on this machine."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if ("varuna_agent" in cmd and ("--job " + job + " ") in cmd) or (b"VARUNA_JOB=" + job.encode() + b"\0") in environ:
            found.append((int(entry.name), cmd.strip()))
    return found


def assert_nothing_left(job, timeout=15):
    wait_for("no process of job %s left (%s)" % (job, processes_of_job(job)), lambda: not processes_of_job(job), timeout)


_started = []  # every Manager a test started: a failing test's job is cleaned up after it


def _kill_leftovers():
    """After a test: SIGKILL its managers still running and every agent and
    worker of their jobs, so one failure does not cascade into the next tests."""
    while _started:
        m = _started.pop()
        m.kill(signal.SIGKILL)
        if m.proc:
            m.proc.wait()
        for pid, _ in processes_of_job(m.job):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_tests(tests):
    """Runs test functions in order; prints a summary; exit code 1 on any failure.

    Test names given on the command line select a subset (for reproducing one case)."""
    wanted = set(sys.argv[1:])
    unknown = wanted - {t.__name__ for t in tests}
    if unknown:
        sys.exit("unknown test(s): %s" % ", ".join(sorted(unknown)))
    tests = [t for t in tests if not wanted or t.__name__ in wanted]
    failed = []
    for test in tests:
        log("---", test.__name__)
        start = time.monotonic()
        try:
            test()
            log("PASS", test.__name__, "(%.1f s)" % (time.monotonic() - start))
        except Exception as e:  # noqa: BLE001 - report every failure, run the rest
            import traceback
            traceback.print_exc()
            log("FAIL", test.__name__, ":", e)
            failed.append(test.__name__)
        _kill_leftovers()
    log("%d/%d passed" % (len(tests) - len(failed), len(tests)), "failed: %s" % failed if failed else "")
    sys.exit(1 if failed else 0)


class StoreWatcher(threading.Thread):
    """Records, every 0.1 s, the newest modification time of each file a
    given generation has in the store: its partial folders (`.g<G>.partial`)
    and the complete checkpoints whose manifest names it. Retention removes
    files as the job goes on; polling sees them before that."""

    def __init__(self, store, generation):
        super().__init__(daemon=True)
        self.store, self.tag, self.generation = Path(store), ".g%d.partial" % generation, generation
        self.writes = {}  # path -> newest mtime (s)
        self.done = threading.Event()

    def owned(self, folder):
        if self.tag in folder.name:
            return True
        try:
            return json.loads((folder / "manifest.json").read_text()).get("generation") == self.generation
        except (OSError, ValueError):
            return False

    def scan(self):
        if not self.store.exists():
            return
        for folder in list(self.store.glob("varuna_ckpt_*")):
            try:
                if not folder.is_dir() or not self.owned(folder):
                    continue
                for f in folder.rglob("*"):
                    if not f.is_file():
                        continue  # a folder's time changes when retention empties it
                    mtime = f.stat().st_mtime
                    self.writes[str(f)] = max(mtime, self.writes.get(str(f), 0))
            except OSError:
                continue  # removed while looking

    def run(self):
        while not self.done.is_set():
            self.scan()
            time.sleep(0.1)
        self.scan()

    def latest(self):
        return max(self.writes.values(), default=0)

    def stop(self):
        self.done.set()
        self.join()

    def assert_none_after(self, next_launch):
        """Stops watching, then fails unless the generation wrote files into
        the store (else the test proves nothing) and none of them after
        `next_launch`, the next generation's launch event."""
        self.stop()
        launched_at = next_launch["unix_ms"] / 1000
        assert self.writes, "generation %d wrote no checkpoint: the test proves nothing" % self.generation
        late = {p: t for p, t in self.writes.items() if t > launched_at}
        log("generation %d: %d files in the store, the newest %.2f s before the next launch"
            % (self.generation, len(self.writes), launched_at - self.latest()))
        assert not late, "generation %d wrote after the next generation was launched: %s" % (self.generation, late)
