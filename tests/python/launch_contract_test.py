#!/usr/bin/env python3
"""The launch contract's two sides agree: scripts/varuna_launch.py (Python)
writes what common/launch_contract.h (C++) writes, and a worker decodes it.

  encoders agree   varuna_launch's launcher_argv and rendezvous_environment
                   give the C++ launcherArgv and rendezvousEnvironment's
                   output for the same values (with and without a resume
                   step, one stage or several)
  worker decodes   a 2 x 2 job started by varuna_launch.py of
                   launch_contract_probe: every rank decodes its rank, place,
                   batch and rendezvous as launched, the program's own
                   arguments left to it

    launch_contract_test.py [name ...]
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checks  # noqa: E402

PROBE = os.environ["LAUNCH_CONTRACT_PROBE"]
LAUNCHER = os.path.join(checks.SOURCE, "scripts", "varuna_launch.py")
_spec = importlib.util.spec_from_file_location("varuna_launch", LAUNCHER)
varuna_launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(varuna_launch)


def cpp_encode(rank, local_rank, world, stage_map, chunk, batch, resume, addr, port):
    r = subprocess.run([PROBE, "encode", str(rank), str(local_rank), str(world), stage_map, str(chunk), str(batch),
                        str(resume), addr, str(port)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_encoders_agree():
    cases = [
        (3, 1, 4, "0,2;1,3;", 2, 8, 120, "10.0.0.7", 24650),
        (0, 0, 1, "0;", 4, 16, -1, "127.0.0.1", 29500),
        (5, 5, 6, "0,3;1,4;2,5;", 1, 3, 0, "host-a", 1025),
    ]
    for rank, local, world, stage_map, chunk, batch, resume, addr, port in cases:
        want = cpp_encode(rank, local, world, stage_map, chunk, batch, resume, addr, port)
        got_argv = varuna_launch.launcher_argv(rank, local, stage_map, chunk, batch, None if resume < 0 else resume)
        got_env = varuna_launch.rendezvous_environment(rank, local, world, addr, port)
        assert got_argv == want["argv"], (got_argv, want["argv"])
        assert got_env == want["env"], (got_env, want["env"])


def test_worker_decodes_what_varuna_launch_wrote():
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run([sys.executable, LAUNCHER, "--nstages", "2", "--replicas", "2", "--chunk_size", "2",
                            "--batch_size", "16", "--resume_step", "40", "--", PROBE, "decode", out, "--lr", "0.5"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        decoded = {}
        for rank in range(4):
            with open(os.path.join(out, "rank%d.json" % rank)) as f:
                decoded[rank] = json.load(f)
    ports = {d["master_port"] for d in decoded.values()}
    assert len(ports) == 1, ports
    for rank, d in decoded.items():
        assert d["rank"] == rank and d["local_rank"] == rank and d["world_size"] == 4, d
        assert d["stage_to_rank_map"] == "0,2;1,3;", d
        assert (d["stage"], d["replica"]) == (rank % 2, rank // 2), d  # clustered: replica r holds r*P .. r*P+P-1
        assert d["chunk_size"] == 2 and d["replica_batch_size"] == 8 and d["global_batch"] == 16, d
        assert d["resume_step"] == 40 and d["master_addr"] == "127.0.0.1", d
        assert d["user_args"] == ["--lr", "0.5"], d


checks.run(dict(globals()))
