#!/usr/bin/env python3
"""scripts/varuna_launch.py --preload: workers forked from a launcher that
imported torch and varuna once. A 2 x 2 job of a Python worker: each rank gets
its own arguments, environment and sys.argv, and runs as __main__ in its own
process with SIGUSR1 blocked; a rank's sys.exit(3) is the launcher's 3, an
uncaught exception 1 with the traceback from the script's own frame; on
their way out they run atexit and wait for their threads; a SIGTERM to the
launcher reaches them; with the job token in the environment the launcher
starts fresh interpreters; a program that is not `python SCRIPT` of the
launcher's own interpreter is refused.

    launcher_preload_test.py [name ...]
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checks  # noqa: E402

LAUNCHER = os.path.join(checks.SOURCE, "scripts", "varuna_launch.py")

PRELOADED_WORKER = """
import sys
FORKED = "torch" in sys.modules  # before this script imports anything: only a preloaded launcher has it
import atexit, json, os, signal, threading, time
import varuna
launch = varuna.get_launch_args()
if launch.user_args[:1] == ["exits"]:  # what a fresh interpreter does on its way out
    out = launch.user_args[1]
    atexit.register(lambda: open(os.path.join(out, "atexit%d" % launch.rank), "w").close())
    threading.Thread(target=lambda: (time.sleep(0.5), open(os.path.join(out, "thread%d" % launch.rank), "w").close()),
                     daemon=False).start()
    sys.exit(0)
if launch.user_args[:1] == ["sleep"]:
    open(os.path.join(launch.user_args[1], "ready%d" % launch.rank), "w").close()
    time.sleep(120)
if launch.user_args[:1] == ["fail"]:
    if launch.rank == 1:
        raise ValueError("rank 1 fails on purpose")
    sys.exit(0)
if launch.user_args[:1] == ["exit3"]:
    sys.exit(3 if launch.rank == 2 else 0)
with open(os.path.join(launch.user_args[0], "rank%d.json" % launch.rank), "w") as f:
    json.dump({"rank": launch.rank, "env_rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"],
               "port": os.environ["MASTER_PORT"], "stage_to_rank_map": launch.stage_to_rank_map,
               "user_args": launch.user_args[1:], "argv0": sys.argv[0], "main": __name__,
               "usr1_blocked": signal.SIGUSR1 in signal.pthread_sigmask(signal.SIG_BLOCK, []),
               "pid": os.getpid(), "forked": FORKED}, f)
"""


def command(script, *args):
    return [sys.executable, LAUNCHER, "--nstages", "2", "--replicas", "2", "--chunk_size", "2", "--batch_size", "16",
            "--preload", "torch,varuna", "--", sys.executable, script] + list(args)


def job(script, *args, env=None):
    return subprocess.run(command(script, *args), capture_output=True, text=True, timeout=120, env=env)


def test_preloaded_workers_get_their_own_launch():
    with tempfile.TemporaryDirectory() as out:
        script = os.path.join(out, "worker.py")
        with open(script, "w") as f:
            f.write(PRELOADED_WORKER)

        r = job(script, out, "--lr", "0.5")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "fresh interpreters" not in r.stderr, r.stderr
        decoded = {}
        for rank in range(4):
            with open(os.path.join(out, "rank%d.json" % rank)) as f:
                decoded[rank] = json.load(f)
        assert len({d["port"] for d in decoded.values()}) == 1, decoded
        assert len({d["pid"] for d in decoded.values()}) == 4, decoded
        for rank, d in decoded.items():
            assert d["rank"] == rank and d["env_rank"] == str(rank) and d["world"] == "4", d
            assert d["stage_to_rank_map"] == "0,2;1,3;" and d["user_args"] == ["--lr", "0.5"], d
            assert d["argv0"] == script and d["main"] == "__main__" and d["usr1_blocked"], d
            assert d["forked"], d  # torch was there before the script imported it: forked, not started afresh

        r = job(script, "exit3")
        assert r.returncode == 3, (r.returncode, r.stderr)
        r = job(script, "fail")
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert "ValueError: rank 1 fails on purpose" in r.stderr, r.stderr
        assert 'File "%s"' % script in r.stderr and "runpy" not in r.stderr, r.stderr
        assert "rank 1 exited with code 1" in r.stderr, r.stderr

        # On its way out a forked worker runs atexit and waits for its threads.
        r = job(script, "exits", out)
        assert r.returncode == 0, r.stderr
        for rank in range(4):
            for what in ("atexit", "thread"):
                assert os.path.exists(os.path.join(out, "%s%d" % (what, rank))), (what, rank, r.stderr)

        # With the job token in the environment: fresh interpreters (the token
        # must not stay in a forked worker's /proc/<pid>/environ).
        r = job(script, out, env=dict(os.environ, VARUNA_JOB_TOKEN="tok-preload-test"))
        assert r.returncode == 0 and "fresh interpreters" in r.stderr, (r.returncode, r.stderr)
        with open(os.path.join(out, "rank0.json")) as f:
            assert not json.load(f)["forked"]


def test_a_signal_to_the_launcher_reaches_forked_workers():
    with tempfile.TemporaryDirectory() as out:
        script = os.path.join(out, "worker.py")
        with open(script, "w") as f:
            f.write(PRELOADED_WORKER)
        proc = subprocess.Popen(command(script, "sleep", out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        deadline = time.monotonic() + 120
        while not all(os.path.exists(os.path.join(out, "ready%d" % r)) for r in range(4)):
            assert time.monotonic() < deadline and proc.poll() is None, "the workers never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 1, (proc.returncode, stderr)
        assert "killed by signal %d" % signal.SIGTERM in stderr, stderr


def test_refusals():
    # Not a Python script: refused, naming the form it needs.
    r = subprocess.run([sys.executable, LAUNCHER, "--nstages", "1", "--chunk_size", "1", "--batch_size", "1",
                        "--preload", "torch", "--", "/bin/true"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "python SCRIPT" in r.stderr, (r.returncode, r.stderr)
    # Another interpreter than the launcher's: refused (the workers would run in the launcher's).
    r = subprocess.run([sys.executable, LAUNCHER, "--nstages", "1", "--chunk_size", "1", "--batch_size", "1",
                        "--preload", "torch", "--", "python3", "-c", "pass"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "python SCRIPT" in r.stderr, (r.returncode, r.stderr)
    with tempfile.TemporaryDirectory() as out:
        script = os.path.join(out, "w.py")
        open(script, "w").close()
        r = subprocess.run([sys.executable, LAUNCHER, "--nstages", "1", "--chunk_size", "1", "--batch_size", "1",
                            "--preload", "torch", "--", "/usr/bin/python3", script], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode != 0 and "launcher's own interpreter" in r.stderr, (r.returncode, r.stderr)


checks.run(dict(globals()))
