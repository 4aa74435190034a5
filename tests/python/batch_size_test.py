#!/usr/bin/env python3
"""One meaning for batch size, the global batch:

  the docs' example   the complete program of docs/python.md, written to a
                      file as it stands there and launched by the command
                      the docs give (varuna_launch.py --batch_size 64, 2x2),
                      trains: each replica takes 32 samples a step
  launch args         get_launch_args() gives the global batch, the
                      per-replica share, the replica count and index
  mismatch            Varuna(batch_size=) other than the launcher's global
                      batch is refused naming both; varuna_launch.py refuses a
                      global batch its replicas do not divide

    batch_size_test.py [name ...]
"""
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checks  # noqa: E402
import varuna  # noqa: E402

failures = checks.failures
DOCS = os.path.join(checks.SOURCE, "docs", "python.md")


def docs_example():
    """(program, launch command) of docs/python.md's "A complete program"."""
    with open(DOCS) as f:
        text = f.read()
    section = text[text.index("## A complete program"):]
    program = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shell = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    launch = " ".join(line.rstrip("\\").strip() for line in shell.splitlines() if "varuna_launch.py" in line or
                      line.strip().startswith("-- ")).split()
    return program, launch


def test_the_docs_example_trains_as_documented():
    program, launch = docs_example()
    with tempfile.TemporaryDirectory() as work:
        with open(os.path.join(work, "train.py"), "w") as f:
            f.write(program.replace('"/tmp/varuna-example"', repr(os.path.join(work, "store"))))
        cmd = [sys.executable if a == ".venv/bin/python" else a for a in launch]
        cmd = [os.path.join(checks.SOURCE, a) if a.startswith("scripts/") else a for a in cmd]
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError("the docs' example failed (%d): %s" % (proc.returncode, proc.stderr[-2500:]))
    if "--batch_size 64" not in " ".join(launch) or "global batch 64 (32 per replica)" not in proc.stdout:
        failures.append("the example did not run with a global batch of 64: %s %s" % (launch, proc.stdout[:500]))
    losses = [float(line.split()[3]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    if len(losses) < 3:
        failures.append("the example printed too few steps: %s" % proc.stdout[-1000:])


def test_launch_args_give_the_global_batch():
    args = varuna.get_launch_args(["train.py", "--rank", "3", "--stage_to_rank_map", "0,2;1,3;", "--batch-size", "16"])
    got = (args.batch_size, args.replica_batch_size, args.stages, args.replicas, args.stage, args.replica)
    if got != (32, 16, 2, 2, 1, 1):
        failures.append("launch args (batch, per replica, stages, replicas, stage, replica) %s" % (got,))


def test_a_mismatch_is_refused_naming_both():
    args = varuna.get_launch_args(["train.py", "--rank", "0", "--stage_to_rank_map", "0;", "--batch-size", "16",
                                   "--master_port", "1"])
    try:
        varuna.Varuna([("p", lambda: Piece())], get_batch_fn=lambda n, d: {"x": __import__("torch").zeros(n, 2)},
                      batch_size=64, chunk_size=4, launch_args=args)
    except varuna.ConfigError as error:
        message = str(error)
    else:
        raise AssertionError("a batch_size other than the launcher's was accepted")
    for expected in ("64", "16", "give the same global batch"):
        if expected not in message:
            failures.append("the refusal lacks %r: %s" % (expected, message))
    proc = subprocess.run([sys.executable, os.path.join(checks.SOURCE, "scripts", "varuna_launch.py"), "--nstages",
                           "1", "--replicas", "3", "--chunk_size", "1", "--batch_size", "16", "--", "true"],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode == 0 or "--batch_size 16 (the global batch) must be a positive multiple of --replicas 3" \
            not in proc.stderr:
        failures.append("varuna_launch.py accepted 16 samples for 3 replicas: %d %s" % (proc.returncode,
                                                                                      proc.stderr[-500:]))


class Piece(__import__("torch").nn.Module):
    def __init__(self):
        super().__init__()
        self.w = __import__("torch").nn.Linear(2, 1)

    def forward(self, activation, inputs):
        return self.w(inputs["x"]).mean()


if __name__ == "__main__":
    checks.run(globals())
