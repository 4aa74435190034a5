#!/usr/bin/env python3
"""Checkpoint files are readable from Python with torch.load.

Trains the example as 2 stages x 1 replica for 3 steps with a checkpoint, then
loads every piece's parameter and optimizer file with torch.load (the project's
torch wheel) and checks each tensor against the plain-JSON summary the C++
program wrote of its parameters (shape, sum, first values).
"""
import glob
import json
import os
import subprocess
import sys
import tempfile

import torch

BUILD = os.environ.get("VARUNA_BUILD_DIR", "build")
SOURCE = os.environ.get("VARUNA_SOURCE_DIR", ".")
failures = []
passed = 0


def check(condition, message):
    global passed
    if condition:
        passed += 1
    else:
        failures.append(message)


def load(path):
    return torch.load(path)  # weights_only=True, the default: plain tensors and dicts only


def main():
    with tempfile.TemporaryDirectory() as tmp:
        store, dump = os.path.join(tmp, "store"), os.path.join(tmp, "dump")
        cmd = [sys.executable, os.path.join(SOURCE, "scripts", "varuna_launch.py"), "--nstages", "2",
               "--chunk_size", "2", "--batch_size", "4", "--", os.path.join(BUILD, "examples", "gpt", "train_gpt"),
               "--steps", "3", "--d_model", "32", "--heads", "2", "--layers", "2", "--seq_len", "16",
               "--checkpoint_dir", store, "--dump_dir", dump, "--log_level", "warn"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        ckpt = os.path.join(store, "varuna_ckpt_3")
        check(os.path.exists(os.path.join(ckpt, "COMPLETE")), "checkpoint 3 is not complete")
        summary = {}
        for path in glob.glob(os.path.join(dump, "rank*_params.pt.summary.json")):
            summary.update(json.load(open(path)))
        seen = set()
        for path in sorted(glob.glob(os.path.join(ckpt, "piece_*.params.pt"))):
            for name, tensor in load(path).items():
                seen.add(name)
                want = summary[name]
                check(list(tensor.shape) == want["shape"], f"{name}: shape {list(tensor.shape)} vs {want['shape']}")
                total = tensor.double().sum().item()
                check(abs(total - want["sum"]) <= 1e-9 * max(1.0, abs(want["sum"])), f"{name}: sum {total} vs {want['sum']}")
                first = tensor.flatten()[:4].double().tolist()
                check(first == want["first"], f"{name}: first values {first} vs {want['first']}")
        check(seen == set(summary), f"parameters in the checkpoint {sorted(seen)} vs written {sorted(summary)}")
        optim = {}
        for path in glob.glob(os.path.join(ckpt, "piece_*.optim.pt")):
            optim.update(load(path))
        for name in summary:
            check(f"{name}/exp_avg" in optim and optim[f"{name}/exp_avg"].shape == tuple(summary[name]["shape"]),
                  f"{name}: no AdamW state")
            check(int(optim[f"{name}/step"].item()) == 3, f"{name}: AdamW step {optim[f'{name}/step']}")
        meta = json.load(open(os.path.join(ckpt, "meta.json")))
        check(meta["step"] == 3 and meta["samples_seen"] == 12, f"meta: {meta}")
        # The dumped parameter files load too.
        for path in glob.glob(os.path.join(dump, "rank*_params.pt")):
            check(len(load(path)) > 0, f"{path} is empty")
    for f in failures:
        print("FAILED:", f)
    print(f"{passed} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
