#!/usr/bin/env python3
"""The job token leaves a worker's environment once the runtime has it
(P15): a worker started with VARUNA_JOB_TOKEN in its environment (as
run_varuna's agent starts them) builds varuna.Varuna, after which neither
os.environ, nor /proc/<pid>/environ, nor a process it starts holds the
token; and it still trains.

    secret_env_test.py [name ...]
    secret_env_test.py --worker --out DIR   (one rank)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checks  # noqa: E402

TOKEN = "tok-secret-env-test-0123456789abcdef"
failures = checks.failures


def worker():
    import cutpoint_model as cm
    import varuna
    launch = varuna.get_launch_args()
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(launch.user_args)
    try:
        before = TOKEN in os.environ.get("VARUNA_JOB_TOKEN", "")
        model = varuna.Varuna(cm.build(), launch.stage_to_rank_map, cm.get_batch, 4, launch.chunk_size,
                              launch_args=launch, shared_weights=cm.SHARED)
        model.set_optimizer(cm.make_optimizer(model.parameters()))
        loss = model.step(cm.global_batch(0, 4)).loss
        with open("/proc/self/environ", "rb") as f:
            proc_environ = f.read()
        child = subprocess.run(["env"], capture_output=True, text=True).stdout
        found = {"before": before, "os.environ": "VARUNA_JOB_TOKEN" in os.environ,
                 "proc_environ": TOKEN.encode() in proc_environ, "child": TOKEN in child, "loss": loss}
        with open(os.path.join(args.out, "rank_%d.json" % launch.rank), "w") as f:
            json.dump(found, f)
    except Exception as error:  # noqa: BLE001 - every failure ends the worker with its code
        varuna.exit_after_failure(error)


def test_the_token_leaves_the_environment_once_read():
    os.environ["VARUNA_JOB_TOKEN"] = TOKEN  # what run_varuna's agent hands a worker
    try:
        with tempfile.TemporaryDirectory() as out:
            # A fresh interpreter, as run_varuna's agent starts one (varuna_launch.py
            # would not fork with the token set anyway).
            proc = checks.launch(os.path.abspath(__file__), 1, 1, 2, 4, ["--worker", "--out", out], preload="")
            if proc.returncode != 0:
                raise AssertionError("the worker failed (%d): %s" % (proc.returncode, checks.output_of(proc)))
            with open(os.path.join(out, "rank_0.json")) as f:
                found = json.load(f)
    finally:
        del os.environ["VARUNA_JOB_TOKEN"]
    if not found["before"]:
        failures.append("the worker did not get the token at all: the test proves nothing")
    for where in ("os.environ", "proc_environ", "child"):
        if found[where]:
            failures.append("the token is still in the worker's %s after varuna.Varuna()" % where)
    if not found["loss"] > 0:
        failures.append("the worker did not train: loss %r" % found["loss"])


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        checks.run(globals())
