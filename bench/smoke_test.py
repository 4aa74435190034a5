#!/usr/bin/env python3
"""Runs one benchmark in its smoke mode and checks that it still runs.

    smoke_test.py --expect key[,key...] [--timeout S] -- COMMAND...

Passes when COMMAND exits 0 and the last non-empty line of its stdout is a JSON
object holding every --expect key with a value (not null): the benchmark ran to
completion and printed its figures. The figures themselves are never judged
(a smoke run is seconds long on a shared machine). CTest runs one of these per
benchmark (label bench, bench/CMakeLists.txt), so that a benchmark that no
longer runs fails CI.

The benchmark runs in its own session. After --timeout seconds it gets SIGTERM
(bench_morph and bench_manager_scale clean up what they started on it), then
its whole process group SIGKILL as soon as it has exited, or 15 s later: a
hung benchmark fails here, before CTest's own timeout, and leaves nothing
behind in its process group. Its output is passed
through as it comes, so `ctest --output-on-failure` shows it. When TMPDIR is
set (CTest sets a folder of its own per test), it is created first.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect", required=True, help="comma-separated keys the last JSON line must hold")
    parser.add_argument("--timeout", type=float, default=240, help="seconds before the benchmark is stopped")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark's command line")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no benchmark command after --")
    if os.environ.get("TMPDIR"):
        os.makedirs(os.environ["TMPDIR"], exist_ok=True)

    print("smoke_test: running %s" % " ".join(command), flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    timed_out = threading.Event()

    def stop():
        timed_out.set()
        print("smoke_test: still running after %.0f s: SIGTERM" % args.timeout, flush=True)
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(args.timeout, stop)
    timer.daemon = True
    timer.start()
    last = ""
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if line.strip():
            last = line.strip()
    code = proc.wait()
    timer.cancel()
    elapsed = time.monotonic() - start

    def fail(reason):
        print("smoke_test: FAILED after %.1f s: %s" % (elapsed, reason), flush=True)
        sys.exit(1)

    if timed_out.is_set():
        fail("the benchmark did not finish within %.0f s" % args.timeout)
    if code != 0:
        fail("the benchmark exited with %s" % (code if code >= 0 else "signal %d" % -code))
    try:
        figures = json.loads(last)
    except ValueError:
        fail("its last line is not JSON: %r" % last[:300])
    if not isinstance(figures, dict):
        fail("its last line is JSON but not an object: %r" % last[:300])
    missing = [k for k in args.expect.split(",") if figures.get(k) is None]
    if missing:
        fail("its JSON line lacks %s" % ", ".join(missing))
    print("smoke_test: ok in %.1f s (figures not judged)" % elapsed, flush=True)


if __name__ == "__main__":
    main()
