#!/usr/bin/env python3
"""bench/pipeline: Varuna's pipeline runtime against torch.distributed.pipelining.

Runs the example GPT at P=2 stages, D=1, m=8 micro-batches, one thread per
process, at two sizes, and in the same run the peer (Schedule1F1B and
ScheduleGPipe from the same torch wheel, same model, weights, data and thread
settings). Prints a table, then as its last line one JSON object:

  {"small": {"tokens_per_s", "peer_tokens_per_s", "ratio_vs_peer", "bubble_bound",
             "efficiency", ...}, "medium": {...}}

efficiency = single-process step time / (P x pipelined step time), for the best
of our schedules; bubble_bound = m / (m + P - 1).

    .venv/bin/python bench/pipeline/bench_pipeline.py [--build build] [--quick]
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

SIZES = {
    # framework overhead matters
    "small": dict(d_model=128, layers=8, heads=4, seq_len=64, chunk=4, warmup=3, steps=12),
    # compute-bound
    "medium": dict(d_model=256, layers=8, heads=4, seq_len=128, chunk=2, warmup=2, steps=6),
}
P, M = 2, 8


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ours(build, size, stages, schedule, dump):
    cfg = SIZES[size]
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "varuna_launch.py"), "--nstages", str(stages),
           "--chunk_size", str(cfg["chunk"]), "--batch_size", str(cfg["chunk"] * M), "--",
           os.path.join(build, "examples", "gpt", "train_gpt"), "--steps", str(cfg["warmup"] + cfg["steps"]),
           "--d_model", str(cfg["d_model"]), "--layers", str(cfg["layers"]), "--heads", str(cfg["heads"]),
           "--seq_len", str(cfg["seq_len"]), "--schedule", schedule, "--clip", "0", "--threads", "1",
           "--dump_dir", dump, "--log_level", "warn", "--log_every", "1000000"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(dump, "rank0_steps.jsonl")) as f:
        times = [json.loads(line)["time_s"] for line in f]
    return statistics.median(times[cfg["warmup"]:])


def run_peer(size, schedule, weights):
    cfg = SIZES[size]
    port = free_port()
    procs = []
    for rank in range(2):
        cmd = [sys.executable, os.path.join(HERE, "peer_pipelining.py"), "--rank", str(rank), "--port", str(port),
               "--schedule", schedule, "--d_model", str(cfg["d_model"]), "--layers", str(cfg["layers"]),
               "--heads", str(cfg["heads"]), "--seq_len", str(cfg["seq_len"]), "--batch", str(cfg["chunk"] * M),
               "--microbatches", str(M), "--warmup", str(cfg["warmup"]), "--steps", str(cfg["steps"]),
               "--weights", weights]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env))
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"peer {schedule} failed")
    return json.loads(outputs[1].strip().splitlines()[-1])["step_time_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--sizes", default="small,medium")
    args = parser.parse_args()
    result = {}
    for size in args.sizes.split(","):
        cfg = SIZES[size]
        tokens = cfg["chunk"] * M * cfg["seq_len"]
        with tempfile.TemporaryDirectory() as tmp:
            ours = {}
            for schedule in ("varuna", "1f1b", "gpipe"):
                dump = os.path.join(tmp, schedule)
                ours[schedule] = run_ours(args.build, size, P, schedule, dump)
                print(f"[{size}] ours {schedule:7s} P=2: {ours[schedule]*1e3:8.1f} ms/step", flush=True)
            single = run_ours(args.build, size, 1, "1f1b", os.path.join(tmp, "single"))
            print(f"[{size}] ours single process: {single*1e3:8.1f} ms/step", flush=True)
            peer = {}
            for schedule in ("1F1B", "GPipe"):
                peer[schedule] = run_peer(size, schedule, os.path.join(tmp, "1f1b"))
                print(f"[{size}] peer {schedule:6s} P=2: {peer[schedule]*1e3:8.1f} ms/step", flush=True)
        best = min(ours, key=ours.get)
        best_peer = min(peer, key=peer.get)
        result[size] = {
            "config": {k: cfg[k] for k in ("d_model", "layers", "seq_len", "chunk")} | {"P": P, "m": M},
            "tokens_per_s": tokens / ours[best],
            "best_schedule": best,
            "ours_step_s": ours,
            "single_process_step_s": single,
            "peer_tokens_per_s": tokens / peer[best_peer],
            "peer_best_schedule": best_peer,
            "peer_step_s": peer,
            "ratio_vs_peer": peer[best_peer] / ours[best],
            "bubble_bound": M / (M + P - 1),
            "efficiency": single / (P * ours[best]),
        }
        r = result[size]
        print(f"[{size}] tokens/s ours {r['tokens_per_s']:.0f} ({best}) vs peer {r['peer_tokens_per_s']:.0f} "
              f"({best_peer}): ratio {r['ratio_vs_peer']:.2f}; efficiency {r['efficiency']:.3f} "
              f"(bubble bound {r['bubble_bound']:.3f})", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
