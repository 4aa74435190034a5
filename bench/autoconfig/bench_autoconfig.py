#!/usr/bin/env python3
"""bench/autoconfig: how well the simulator predicts, and how good AutoConfig's choice is.

1. Profiles the example GPT on this machine with 2 processes (profile_gpt).
2. Asks AutoConfig (predict_plans) for every feasible plan on 2 slots
   (P in {1, 2}, every profiled micro-batch size, each schedule) with its
   predicted step time, and the plan it would choose.
3. Runs every plan for real (train_gpt under scripts/varuna_launch.py, with the
   schedule and the partition costs AutoConfig used, as run_varuna passes
   them) and takes the median step time after warm-up, best of --rounds
   interleaved rounds (this VM's speed drifts).
4. Prints a table and, as its last line, one JSON object:
   {"plans", "prediction_error_median", "prediction_error_max",
    "chosen_vs_best_measured", "chosen", "best_measured", ...}
   prediction error = |predicted - measured| / measured;
   chosen_vs_best_measured = measured throughput of the chosen plan / best measured,
   both from a final: the sweep's --finalists fastest plans and the chosen one
   measured again in --final_rounds interleaved rounds, median per plan (the
   sweep's own figure is reported too, as sweep_chosen_vs_best).

    .venv/bin/python bench/autoconfig/bench_autoconfig.py [--build build] [--rounds 3] [--keep DIR]
    .venv/bin/python bench/autoconfig/bench_autoconfig.py --smoke   # does it still run? (seconds, not judged)

--smoke: every step above once, small: a tiny GPT (d_model 32, 2 blocks, seq
16), a profile of micro-batch size 2 with 3 repetitions, its 1f1b plans only
(3), 1 round of 3 steps (1 warm-up), a final
of the fastest plan and the chosen one in 1 round. The same table and JSON
line without "targets": the figures mean nothing. CTest runs it (label bench).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODEL = ["--d_model", "128", "--layers", "4", "--heads", "4", "--seq_len", "64", "--threads", "1"]
SMOKE_MODEL = ["--d_model", "32", "--layers", "2", "--heads", "2", "--seq_len", "16", "--threads", "1"]
BATCH = 16
sys.path.insert(0, os.path.join(ROOT, "bench", "common"))
from bench_support import profile_gpt_argv  # noqa: E402


def log(*parts):
    print("[bench_autoconfig %s]" % time.strftime("%H:%M:%S"), *parts, flush=True)


def run(cmd, env=None, timeout=600):
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if result.returncode != 0:
        sys.exit("command failed (%d): %s\n%s%s" % (result.returncode, " ".join(cmd), result.stdout[-3000:],
                                                     result.stderr[-3000:]))
    return result


def launch(build, stages, replicas, chunk, per_replica_batch, program_args, env=None, timeout=600):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "varuna_launch.py"), "--nstages", str(stages),
           "--replicas", str(replicas), "--chunk_size", str(chunk), "--replica_batch_size", str(per_replica_batch), "--",
           *program_args]
    return run(cmd, env=env, timeout=timeout)


def profile(build, workdir, sizes, repetitions):
    log("profiling the example with 2 processes, micro-batch sizes", sizes)
    start = time.monotonic()
    run(profile_gpt_argv(build, workdir, sizes, repetitions, MODEL))
    log("profile written in %.0f s" % (time.monotonic() - start))
    return os.path.join(workdir, "profile.json")


def measure(build, plan, workdir, steps, warmup):
    """Median step time (s) of rank 0 after `warmup` steps."""
    dump = os.path.join(workdir, "run-" + plan["name"].replace(" ", "_").replace("=", ""))
    shutil.rmtree(dump, ignore_errors=True)
    os.makedirs(dump)
    env = dict(os.environ, VARUNA_SCHEDULE=plan["schedule"],
               VARUNA_PIECE_COSTS=",".join(repr(c) for c in plan["piece_costs"]))
    launch(build, plan["stages"], plan["replicas"], plan["chunk_size"], plan["per_replica_batch"],
           [os.path.join(build, "examples", "gpt", "train_gpt"), "--steps", str(steps), "--dump_dir", dump, *MODEL],
           env=env)
    times = [json.loads(line)["time_s"] for line in open(os.path.join(dump, "rank0_steps.jsonl"))]
    return statistics.median(times[warmup:])


def final_round(build, workdir, args, rows, chosen):
    """The sweep's fastest plans plus the chosen one, measured again in
    --final_rounds interleaved rounds; each plan's figure is its median.

    Picking the fastest of 36 noisy figures favours the luckiest draw (the
    winner's curse): on this VM one plan's rounds differ by 20 % and more, more
    than the gaps between the leaders. A final among a few plans with more
    rounds compares like with like."""
    finalists = [r for r in rows[:args.finalists]]
    if chosen not in finalists:
        finalists.append(chosen)
    log("final: %s, %d interleaved rounds" % (", ".join(r["name"] for r in finalists), args.final_rounds))
    times = {r["name"]: [] for r in finalists}
    for rnd in range(args.final_rounds):
        for r in finalists:
            times[r["name"]].append(measure(build, r, workdir, args.steps, args.warmup))
    print("\n%-22s %10s %s" % ("final", "median", "rounds"))
    final = {name: statistics.median(t) for name, t in times.items()}
    for name in sorted(final, key=final.get):
        print("%-22s %9.4fs %s%s" % (name, final[name], " ".join("%.4f" % x for x in times[name]),
                                     "  <- chosen" if name == chosen["name"] else ""))
    return final


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--finalists", type=int, default=4, help="fastest plans of the sweep measured again")
    parser.add_argument("--final_rounds", type=int, default=5)
    parser.add_argument("--sizes", default="1,2,4,8", help="micro-batch sizes to profile")
    parser.add_argument("--schedules", default="all")
    parser.add_argument("--repetitions", type=int, default=60, help="profile_gpt's repetitions per size")
    parser.add_argument("--keep", help="keep the work files in this folder")
    parser.add_argument("--smoke", action="store_true",
                        help="everything once at the smallest settings (seconds; figures not judged): "
                             "does the bench still run?")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.warmup, args.finalists, args.final_rounds = 1, 3, 1, 1, 1
        args.sizes, args.schedules, args.repetitions = "2", "1f1b", 3
        MODEL[:] = SMOKE_MODEL
    build = os.path.abspath(args.build)
    workdir = args.keep or tempfile.mkdtemp(prefix="bench-autoconfig-")
    os.makedirs(workdir, exist_ok=True)
    try:
        profile_path = profile(build, workdir, args.sizes, args.repetitions)
        predicted = json.loads(run([os.path.join(build, "bench", "predict_plans"), "--profile", profile_path,
                                    "--machines", "127.0.0.1:2", "--batch", str(BATCH),
                                    "--schedules", args.schedules]).stdout)
        plans = predicted["plans"]
        log("AutoConfig:", predicted["explain"])
        log("%d feasible plans; measuring each, %d interleaved rounds" % (len(plans), args.rounds))
        measured = {p["name"]: [] for p in plans}
        for r in range(args.rounds):
            for plan in plans:
                t = measure(build, plan, workdir, args.steps, args.warmup)
                measured[plan["name"]].append(t)
                log("round %d %-22s predicted %.4f s measured %.4f s" % (r + 1, plan["name"], plan["predicted_step_s"], t))
        rows = []
        for plan in plans:
            samples = measured[plan["name"]]
            best = min(samples)
            error = abs(plan["predicted_step_s"] - best) / best
            rows.append(dict(plan, measured_step_s=best, error=error, round_spread=(max(samples) - best) / best))
        rows.sort(key=lambda r: r["measured_step_s"])
        # round spread: (slowest - fastest round) / fastest, the noise each figure carries
        print("\n%-22s %10s %10s %7s %13s %s" % ("plan", "predicted", "measured", "error", "round spread", ""))
        for r in rows:
            print("%-22s %9.4fs %9.4fs %6.1f%% %12.1f%% %s" % (
                r["name"], r["predicted_step_s"], r["measured_step_s"], 100 * r["error"], 100 * r["round_spread"],
                "<- chosen" if r["chosen"] else ""))
        chosen = next(r for r in rows if r["chosen"])
        errors = [r["error"] for r in rows]
        final = final_round(build, workdir, args, rows, chosen)
        best_name = min(final, key=final.get)
        ratio = final[best_name] / final[chosen["name"]]
        summary = {
            "plans": len(rows),
            "prediction_error_median": round(statistics.median(errors), 4),
            "prediction_error_max": round(max(errors), 4),
            "chosen_vs_best_measured": round(ratio, 4),
            "chosen": chosen["name"],
            "best_measured": best_name,
            "sweep_chosen_vs_best": round(rows[0]["measured_step_s"] / chosen["measured_step_s"], 4),
            "sweep_best": rows[0]["name"],
            "targets": {"prediction_error_median<=0.15": statistics.median(errors) <= 0.15,
                        "chosen_vs_best_measured>=0.95": ratio >= 0.95},
            "round_spread_median": round(statistics.median(r["round_spread"] for r in rows), 4),
            "model": " ".join(MODEL), "global_batch": BATCH, "rounds": args.rounds, "steps": args.steps,
        }
        if args.smoke:
            del summary["targets"]
            summary["smoke"] = True
        print(json.dumps(summary))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
