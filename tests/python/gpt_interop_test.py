#!/usr/bin/env python3
"""The example GPT in Python (examples/python/train_gpt.py) against the C++ one
(build/examples/gpt/train_gpt), both launched by scripts/varuna_launch.py:

  same_initial_weights   the Python pieces, built as the runtime builds them
                         (manual_seed(seed + index)), equal the C++ example's
                         initial parameters bit for bit
  cpp_to_python          a checkpoint of the C++ job resumes in the Python
                         job, whose losses then equal the C++ job's own
                         uninterrupted ones
  python_to_cpp          and the reverse

    gpt_interop_test.py [name ...]
"""
import json
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.environ.get("VARUNA_SOURCE_DIR", os.path.dirname(os.path.dirname(HERE)))
BUILD = os.environ.get("VARUNA_BUILD_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "examples", "python"))
import gpt  # noqa: E402
import checks  # noqa: E402

MODEL = ["--layers", "2", "--d_model", "32", "--heads", "2", "--seq_len", "16"]
CPP = [os.path.join(BUILD, "examples", "gpt", "train_gpt")]
PY = [sys.executable, os.path.join(SOURCE, "examples", "python", "train_gpt.py")]
failures = checks.failures


def launch(program, args, stages=2, replicas=1, resume=None):
    cmd = [sys.executable, os.path.join(SOURCE, "scripts", "varuna_launch.py"), "--nstages", str(stages),
           "--replicas", str(replicas), "--chunk_size", "2", "--batch_size", "8"]
    if resume is not None:
        cmd += ["--resume_step", str(resume)]
    proc = subprocess.run(cmd + ["--"] + program + MODEL + args, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError("%s failed (%d):\n%s" % (" ".join(program[-1:] + args), proc.returncode,
                                                     (proc.stdout + proc.stderr)[-3000:]))
    return proc


def losses(dump):
    with open(os.path.join(dump, "rank0_steps.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def close(a, b, rtol=1e-5):
    return abs(a - b) <= rtol * max(1.0, abs(b))


def test_same_initial_weights():
    with tempfile.TemporaryDirectory() as tmp:
        launch(CPP, ["--steps", "1", "--dump_dir", tmp], stages=1)
        cpp = torch.load(os.path.join(tmp, "rank0_initial.pt"))
        data = gpt.CharDataset.from_path("/usr/share/common-licenses")
        config = gpt.GptConfig(vocab_size=data.vocab_size, d_model=32, heads=2, layers=2, seq_len=16)
        pieces, shared = gpt.gpt_pieces(config)
        python = {}
        for index, (name, factory, _) in enumerate(pieces):
            torch.manual_seed(config.seed + index)
            for pname, p in factory().named_parameters():
                python["%s.%s" % (name, pname)] = p.detach()
        for first, second in shared:  # the runtime gives the second the first's value at start
            python[second] = python[first]
        if set(cpp) != set(python):
            failures.append("parameter names differ: C++ only %s, Python only %s" % (
                sorted(set(cpp) - set(python)), sorted(set(python) - set(cpp))))
        for name in set(cpp) & set(python):
            if not torch.equal(cpp[name], python[name]):
                failures.append("initial %s differs by %.3g" % (name, (cpp[name] - python[name]).abs().max()))


def resumed(first, second):
    with tempfile.TemporaryDirectory() as tmp:
        store, whole, part = (os.path.join(tmp, d) for d in ("store", "whole", "part"))
        launch(first, ["--steps", "4", "--checkpoint_dir", store, "--checkpoint_every", "2", "--dump_dir", whole])
        launch(second, ["--steps", "4", "--checkpoint_dir", store, "--dump_dir", part], resume=2)
        a, b = losses(whole), losses(part)
        for step in (2, 3):
            if step not in b or not close(b[step], a[step]):
                failures.append("step %d after resuming: %s vs uninterrupted %s" % (step, b.get(step), a[step]))


def test_cpp_to_python():
    resumed(CPP, PY)


def test_python_to_cpp():
    resumed(PY, CPP)


if __name__ == "__main__":
    checks.run(globals())
