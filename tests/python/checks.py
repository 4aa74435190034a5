"""What the Python test scripts here share: a list of failures the checks add
to, the runner of a script's test_* functions (names on the command line
select some), and a job launcher."""
import os
import subprocess
import sys
import time

failures = []
SOURCE = os.environ.get("VARUNA_SOURCE_DIR",
                        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# What the launcher imports once and forks its workers from (varuna_launch.py
# --preload): a test job's worker then starts in a fraction of a second rather
# than spending 4-8 s of CPU on imports, which was most of these tests' time.
PRELOAD = "torch,varuna"


def launch(script, stages, replicas, micro, global_batch, worker_args, timeout=300, preload=PRELOAD):
    """Runs `script` (with worker_args) as a stages x replicas job started by
    scripts/varuna_launch.py on loopback; returns the CompletedProcess.
    `preload`: varuna_launch.py's --preload ("" for a fresh interpreter per
    worker, as a test of the process itself needs)."""
    cmd = [sys.executable, os.path.join(SOURCE, "scripts", "varuna_launch.py"), "--nstages", str(stages),
           "--replicas", str(replicas), "--chunk_size", str(micro), "--batch_size", str(global_batch),
           "--grace", "30", "--preload", preload, "--", sys.executable, script] + [str(a) for a in worker_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def output_of(proc, chars=2500):
    """The end of a finished job's stdout and stderr, for a failure message:
    the launcher passes the workers' output on, some of it on stdout."""
    return "stdout: ...%s\nstderr: ...%s" % ((proc.stdout or "")[-chars:], (proc.stderr or "")[-chars:])


def run(namespace):
    tests = {name: fn for name, fn in namespace.items() if name.startswith("test_")}
    for name in sys.argv[1:] or list(tests):
        before = len(failures)
        started = time.monotonic()
        try:
            tests[name]()
        except AssertionError as error:
            failures.append("%s: %s" % (name, error))
        print("%s %s (%.1f s)" % ("PASS" if len(failures) == before else "FAIL", name, time.monotonic() - started),
              flush=True)
    for f in failures:
        print("FAILED:", f)
    sys.exit(1 if failures else 0)
