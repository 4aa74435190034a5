#!/usr/bin/env python3
"""`run_varuna status --watch` against a state folder whose state.json the
test writes (as the manager does: replaced atomically): every refresh shows
the state as it is then, in a pipe as blocks after a header line, on a
terminal redrawing the screen; --json gives a line of JSON per refresh;
--count stops it, Ctrl-C (SIGINT) ends it with code 0; a missing state.json
is waited for. Waits are on the output, with deadlines."""
import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from varuna_e2e import BIN, log, run_tests  # noqa: E402

ROOT = Path(os.environ.get("VARUNA_TEST_TMPDIR", tempfile.mkdtemp(prefix="varuna-status-")))
shutil.rmtree(ROOT, ignore_errors=True)
ROOT.mkdir(parents=True)
HEADER = "every 0.2 s: run_varuna status --state_dir "


def write_state(state_dir, step, **extra):
    """A state.json as run_varuna writes it (the fields status prints), replaced atomically."""
    state = {"job": "watched", "pid": os.getpid(), "address": "127.0.0.1:4000", "phase": "running",
             "generation": 2, "morphs": 1, "uptime_s": 12.0, "updated": "2026-01-01T00:00:00.000Z",
             "plan": {"stages": 2, "replicas": 1, "chunk_size": 4, "global_batch": 16, "stage_to_rank_map": "0;1;"},
             "progress": {"step": step, "loss": 2.5, "samples_per_s": 100.0},
             "last_checkpoint_step": 100, "global_store": "/store", "checkpoint_failures": 0,
             "hosts": {"127.0.0.1": {"slots": 2, "agent": "up", "preempted": False, "out": None}},
             "slow_machines": [], "stop_reason": "", "events": str(state_dir / "events.jsonl"),
             "metrics_address": "127.0.0.1:9400"}
    state.update(extra)
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / "state.json.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(state_dir / "state.json")
    return state


class Watcher:
    """run_varuna status --watch with its output read as it comes (a pipe, or a pty's master)."""

    def __init__(self, state_dir, *extra, terminal=False):
        argv = [str(BIN / "run_varuna"), "status", "--state_dir", str(state_dir), "--watch", "--interval", "0.2", *extra]
        if terminal:
            self.fd, slave = pty.openpty()
            self.proc = subprocess.Popen(argv, stdout=slave, stderr=subprocess.STDOUT, close_fds=True)
            os.close(slave)
        else:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.fd = self.proc.stdout.fileno()
        self.text = ""

    def read_until(self, predicate, what, timeout=20):
        """Reads output until predicate(all output so far) holds; fails naming `what`."""
        deadline = time.monotonic() + timeout
        while not predicate(self.text):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("timed out waiting for %s; output so far:\n%s" % (what, self.text[-3000:]))
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # a pty's master reads EIO once the program exited
                chunk = b""
            if not chunk:
                if predicate(self.text):
                    break
                raise AssertionError("run_varuna status ended (%s) before %s:\n%s"
                                     % (self.proc.poll(), what, self.text[-3000:]))
            self.text += chunk.decode(errors="replace")
        return self.text

    def interrupt(self, timeout=10):
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout=timeout)
        self.read_rest()
        return code

    def read_rest(self):
        try:
            while True:
                ready, _, _ = select.select([self.fd], [], [], 0.5)
                if not ready:
                    break
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    break
                self.text += chunk.decode(errors="replace")
        except OSError:
            pass

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        else:
            os.close(self.fd)


def frames(text):
    """The refreshes in the output: the text after each header line."""
    return [part for part in text.split(HEADER)[1:]]


def test_each_refresh_shows_the_state_of_the_moment():
    state_dir = ROOT / "pipe" / "state"
    write_state(state_dir, 10)
    w = Watcher(state_dir)
    try:
        w.read_until(lambda t: len(frames(t)) >= 2 and "events " in frames(t)[1], "two refreshes")
        first = frames(w.text)[0]
        assert first.startswith(str(state_dir) + "    "), first[:200]  # the folder, then the time
        assert "\x1b[" not in w.text, "escape sequences into a pipe"
        for line in ["job            watched", "phase          running", "generation     2, morphs 1",
                     "plan           2 stages x 1 replicas, micro-batch 4", "progress       step 10, loss 2.5",
                     "checkpoint     step 100 in /store", "host           127.0.0.1: 2 slot(s), agent up",
                     "metrics        http://127.0.0.1:9400/metrics"]:
            assert line in first, (line, first)
        # The manager writes a new state: a later refresh shows it.
        write_state(state_dir, 20, phase="checkpointing")
        w.read_until(lambda t: "progress       step 20," in frames(t)[-1] and "events " in frames(t)[-1],
                     "a refresh with step 20")
        last = frames(w.text)[-1]
        assert "phase          checkpointing" in last, last
        assert w.interrupt() == 0, "Ctrl-C ends --watch with code 0"
        log("%d refreshes; the last:\n%s" % (len(frames(w.text)), HEADER + last))
    finally:
        w.close()


def test_count_json_and_a_state_that_comes_later():
    state_dir = ROOT / "count" / "state"
    written = write_state(state_dir, 7)
    r = subprocess.run([str(BIN / "run_varuna"), "status", "--state_dir", str(state_dir), "--watch", "--interval",
                        "0.2", "--count", "3"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert len(frames(r.stdout)) == 3, r.stdout
    assert all("progress       step 7," in f for f in frames(r.stdout)), r.stdout
    # --json: one line of JSON per refresh, state.json as it is.
    r = subprocess.run([str(BIN / "run_varuna"), "status", "--state_dir", str(state_dir), "--watch", "--json",
                        "--interval", "0.2", "--count", "2"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(json.loads(line) == written for line in lines), r.stdout
    # No state.json yet (a job starting): said, and waited for.
    later = ROOT / "later" / "state"
    w = Watcher(later)
    try:
        missing = "no job state at %s (is --state_dir the one run_varuna uses?); trying again" % (later / "state.json")
        w.read_until(lambda t: missing in t, "the missing state")
        write_state(later, 3)
        w.read_until(lambda t: "progress       step 3," in t, "the state once written")
        assert w.interrupt() == 0
    finally:
        w.close()


def test_on_a_terminal_each_refresh_redraws_the_screen():
    state_dir = ROOT / "tty" / "state"
    write_state(state_dir, 5)
    w = Watcher(state_dir, "--count", "2", terminal=True)
    try:
        w.read_until(lambda t: t.count("\x1b[H\x1b[2J" + HEADER) == 2 and t.rstrip().endswith("events.jsonl"),
                     "two screens, each cleared first")
        assert w.proc.wait(timeout=10) == 0
        assert "progress       step 5," in w.text.split("\x1b[2J")[-1], w.text
    finally:
        w.close()


def test_bad_arguments_are_clear_errors():
    state_dir = ROOT / "args" / "state"
    write_state(state_dir, 1)
    cases = [(["--watch", "--interval", "0"], "--interval must be at least 0.1"),
             (["--watch", "--count", "-1"], "--count must be >= 0"),
             (["--count", "2"], "--interval and --count go with --watch")]
    for extra, message in cases:
        r = subprocess.run([str(BIN / "run_varuna"), "status", "--state_dir", str(state_dir), *extra],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and message in r.stderr, (extra, r.returncode, r.stderr)
    # Without --watch nothing changed: one status, or the missing folder named.
    r = subprocess.run([str(BIN / "run_varuna"), "status", "--state_dir", str(ROOT / "nowhere")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "no job state at" in r.stderr, r.stderr


if __name__ == "__main__":
    run_tests([
        test_each_refresh_shows_the_state_of_the_moment,
        test_count_json_and_a_state_that_comes_later,
        test_on_a_terminal_each_refresh_redraws_the_screen,
        test_bad_arguments_are_clear_errors,
    ])
