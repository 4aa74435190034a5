#!/usr/bin/env python3
"""How long AutoConfig takes to plan as the cluster grows.

run_varuna plans on its event loop at launch and at every morph, so planning
time is time the manager is deaf to notices and heartbeats. This drives
build/bench/predict_plans (the same autoConfigure run_varuna calls) on a
synthetic profile of a 1.5B-parameter GPT-like model (48 pieces, micro-batch
sizes 1-16, V100-class figures, fp16, 16 GiB devices) for clusters of 8-GPU
hosts, with a constant global batch, and prints per cluster: plans considered,
plans simulated, planning time as run_varuna does it (hopeless plans skipped,
simulations spread over the cores) and, side by side, simulating every plan on
one thread (what the planner did before).

    .venv/bin/python bench/autoconfig/bench_planning.py [--hosts 2,8,32,64] [--batch 1024]
    .venv/bin/python bench/autoconfig/bench_planning.py --smoke   # 2 hosts only: does it still run?

Last line JSON: {"slots": [...], "considered": [...], "simulated": [...],
"planning_s": [...], "every_plan_one_thread_s": [...]}.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timing(seconds):
    return {"median_s": seconds, "min_s": seconds, "max_s": seconds, "spread": 0.0, "samples": 5}


def synthetic_profile(pieces=48, d_model=1600, seq=1024):
    """Per transformer block, per sample: ~0.8 ms forward (63 GFLOP at ~80
    TFLOP/s), twice that backward, the forward again to recompute; the
    activation crossing a cut is seq x d_model fp16; ~30 MB of saved
    activations; 31M parameters."""
    out_bytes = seq * d_model * 2
    blocks = []
    for k in range(pieces):
        sizes = {}
        for b in (1, 2, 4, 8, 16):
            # Small micro-batches use the device less well: +30 % at 1, ~0 at 16.
            efficiency = 1.0 + 0.3 / b
            fwd = 0.0008 * b * efficiency
            sizes[str(b)] = {"forward": timing(fwd), "backward": timing(2 * fwd), "recompute": timing(fwd),
                             "output_bytes": 0 if k == pieces - 1 else out_bytes * b,
                             "saved_activation_bytes": 30 * 2**20 * b,
                             "peak_bytes": 40 * 2**20 * b}
        params = 31_000_000
        blocks.append({"name": f"block{k}", "param_count": params, "param_bytes": 2 * params, "micro_batch": sizes})
    p2p = [{"bytes": n, "same_host_s": 10e-6 + n / 100e9, "cross_host_s": 50e-6 + n / 10e9}
           for n in (2**10, 2**20, 2**24, 2**28)]
    allreduce = []
    for replicas in (2, 4, 8, 16, 32, 64, 128, 256):
        for cross in (False, True):
            bandwidth = 10e9 if cross else 100e9
            for n in (2**20, 2**24, 2**28, 2**30):
                allreduce.append({"bytes": n, "replicas": replicas, "cross_host": cross,
                                  "seconds": 20e-6 * replicas + 2 * (replicas - 1) / replicas * n / bandwidth})
    return {"format": "varuna-profile", "version": 1, "model_fingerprint": "0123456789abcdef", "device": "cuda",
            "precision": "fp16", "host": "synthetic", "created_at": "2026-01-01T00:00:00Z",
            "optimizer_bytes_per_param": 12, "gradient_bytes_per_param": 2, "optimizer_s_per_param": 2e-11,
            "pieces": blocks, "p2p": p2p, "allreduce": allreduce}


def predict(build, profile, hosts, batch, extra):
    machines = ",".join(f"10.0.{h // 250}.{h % 250 + 1}:8" for h in range(hosts))
    cmd = [os.path.join(build, "bench", "predict_plans"), "--profile", profile, "--machines", machines,
           "--batch", str(batch), "--schedules", "all", "--memory_gb", "16"] + extra
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench_planning: {' '.join(cmd[:3])} ... failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default=None, help="cluster sizes in 8-slot hosts (default 2,8,32,64; --smoke: 2)")
    parser.add_argument("--batch", type=int, default=1024, help="global batch (constant, as in a morphing job)")
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--smoke", action="store_true",
                        help="only the smallest cluster (2 hosts; about a second, figures not judged): does the "
                             "bench still run? (--hosts given explicitly wins)")
    args = parser.parse_args()
    if args.hosts is None:
        args.hosts = "2" if args.smoke else "2,8,32,64"
    if not os.path.exists(os.path.join(args.build, "bench", "predict_plans")):
        sys.exit(f"bench_planning: {args.build}/bench/predict_plans not found: build first (scripts/setup.sh)")

    figures = {"slots": [], "considered": [], "simulated": [], "planning_s": [], "every_plan_one_thread_s": []}
    with tempfile.TemporaryDirectory() as tmp:
        profile = os.path.join(tmp, "profile.json")
        with open(profile, "w") as f:
            json.dump(synthetic_profile(), f)
        print(f"{'slots':>6} {'plans':>7} {'simulated':>10} {'planning (s)':>13} {'every plan, 1 thread (s)':>25}  chosen",
              flush=True)
        for hosts in (int(h) for h in args.hosts.split(",")):
            fast = predict(args.build, profile, hosts, args.batch, ["--skip_hopeless"])
            slow = predict(args.build, profile, hosts, args.batch, ["--threads", "1"])
            chosen = next(p["name"] for p in fast["plans"] if p["chosen"])
            slow_chosen = next(p["name"] for p in slow["plans"] if p["chosen"])
            if chosen != slow_chosen:
                sys.exit(f"bench_planning: the choices differ at {hosts * 8} slots: {chosen} vs {slow_chosen}")
            print(f"{hosts * 8:>6} {fast['considered']:>7} {fast['simulated']:>10} {fast['planning_s']:>13.3f} "
                  f"{slow['planning_s']:>25.3f}  {chosen}", flush=True)
            figures["slots"].append(hosts * 8)
            figures["considered"].append(fast["considered"])
            figures["simulated"].append(fast["simulated"])
            figures["planning_s"].append(round(fast["planning_s"], 4))
            figures["every_plan_one_thread_s"].append(round(slow["planning_s"], 4))
    if args.smoke:
        figures["smoke"] = True
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
