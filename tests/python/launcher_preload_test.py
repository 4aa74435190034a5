#!/usr/bin/env python3
"""scripts/varuna_launch.py --preload: workers forked from a launcher that
imported torch and varuna once. A 2 x 2 job of a Python worker: each rank gets
its own arguments, environment and sys.argv, and runs as __main__ in its own
process with SIGUSR1 blocked; a rank's sys.exit(3) is the launcher's 3, an
uncaught exception 1 with the traceback from the script's own frame; a
program that is not `python SCRIPT` is refused.

    launcher_preload_test.py [name ...]
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checks  # noqa: E402

LAUNCHER = os.path.join(checks.SOURCE, "scripts", "varuna_launch.py")

PRELOADED_WORKER = """
import json, os, signal, sys
import varuna
launch = varuna.get_launch_args()
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
               "pid": os.getpid()}, f)
"""


def test_preloaded_workers_get_their_own_launch():
    with tempfile.TemporaryDirectory() as out:
        script = os.path.join(out, "worker.py")
        with open(script, "w") as f:
            f.write(PRELOADED_WORKER)

        def job(*args):
            return subprocess.run([sys.executable, LAUNCHER, "--nstages", "2", "--replicas", "2", "--chunk_size", "2",
                                   "--batch_size", "16", "--preload", "torch,varuna", "--", sys.executable, script]
                                  + list(args), capture_output=True, text=True, timeout=120)

        r = job(out, "--lr", "0.5")
        assert r.returncode == 0, r.stdout + r.stderr
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

        r = job("exit3")
        assert r.returncode == 3, (r.returncode, r.stderr)
        r = job("fail")
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert "ValueError: rank 1 fails on purpose" in r.stderr, r.stderr
        assert 'File "%s"' % script in r.stderr and "runpy" not in r.stderr, r.stderr
        assert "rank 1 exited with code 1" in r.stderr, r.stderr

    # Not a Python script: refused, naming the form it needs.
    r = subprocess.run([sys.executable, LAUNCHER, "--nstages", "1", "--chunk_size", "1", "--batch_size", "1",
                        "--preload", "torch", "--", "/bin/true"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "python SCRIPT" in r.stderr, (r.returncode, r.stderr)


checks.run(dict(globals()))
