#!/usr/bin/env python3
"""Where the Python front end's step time goes, next to the C++ example's, at
one of bench_pipeline.py's sizes and one schedule:

1. C++ and Python runs interleaved (alternating order), each rank's median per
   step split as the runtime measures it: compute (forwards, recomputes and
   backwards of all micro-batches), optimizer, and the rest (waiting for the
   other stage, communication, the runtime's own work). The Python runs go
   through a wrapper that reads the runtime's own step figures, which
   train_gpt.py does not print.
2. One Python run under cProfile (on around each Varuna.step only: the
   runtime calls the pieces' forwards and the optimizer on the training
   thread), each rank's time grouped as the pieces' forwards, the optimizer
   and the rest of Varuna.step, and the top functions by own time. The
   profiler inflates Python's share: read it for where, (1) for how much.

    .venv/bin/python bench/pipeline/profile_python_row.py [--size small] [--schedule 1f1b] [--rounds 3]

A tool for looking, not a benchmark: no JSON line, not run by CTest.
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import runpy
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_pipeline as bench  # noqa: E402


def worker(out, profiled, argv):
    """Runs train_gpt.py (argv: the script, then its arguments), recording what
    the runtime measured of each step (compute per micro-batch, optimizer) as the
    C++ example's rank<r>_steps.jsonl has it; with `profiled`, cProfile is on
    around each Varuna.step only (not the imports, set-up and evaluation)."""
    import varuna.runtime  # the package of --build: the driver put it on PYTHONPATH

    rank = os.environ.get("RANK", "0")
    profile = cProfile.Profile()
    log = open(os.path.join(out, f"rank{rank}_runtime.jsonl"), "w")
    step = varuna.runtime.Varuna.step

    def recorded_step(self, *a, **k):
        if profiled:
            profile.enable()
        start = time.monotonic()
        try:
            result = step(self, *a, **k)
        finally:
            seconds = time.monotonic() - start
            if profiled:
                profile.disable()
        raw = result._raw  # the runtime's own StepResult, which the Python one does not expose (yet)
        log.write(json.dumps({"time_s": seconds, "compute_s_per_microbatch": raw.compute_seconds_per_microbatch,
                              "optimizer_s": raw.optimizer_seconds}) + "\n")
        return result

    varuna.runtime.Varuna.step = recorded_step
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        log.close()
        if profiled:
            profile.dump_stats(os.path.join(out, f"rank{rank}.prof"))


def breakdown(path, warmup):
    """Median per step: time, compute (fwd + recompute + bwd, all micro-batches),
    optimizer, and the rest (waiting for the other stage, communication, the
    runtime's own work)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f][warmup:]
    med = lambda key, k=1: statistics.median(r[key] * k for r in rows)  # noqa: E731
    step, compute, opt = med("time_s"), med("compute_s_per_microbatch", bench.M), med("optimizer_s")
    return {"step": step, "compute": compute, "optimizer": opt, "rest": step - compute - opt}


def report(path, steps, top):
    stats = pstats.Stats(path)
    step_total, forward_total, optimizer_total = stats.total_tt, 0.0, 0.0  # all of it is inside Varuna.step
    for (filename, _line, name), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():
        # A piece's forward never calls another piece's: their cumulative times add up.
        if name == "forward" and filename.endswith(os.path.join("examples", "python", "gpt.py")):
            forward_total += ct
        # The optimizer class's own step (torch/optim/adamw.py), not optimizer.py's wrappers around it.
        if name == "step" and os.path.join("torch", "optim") in filename and "optimizer.py" not in filename:
            optimizer_total = max(optimizer_total, ct)
    groups = {"pieces' forwards (Python, incl. the torch ops they call)": forward_total,
              "optimizer step (Python)": optimizer_total,
              "Varuna.step outside Python (the C++ schedule, backward, communication)":
                  step_total - forward_total - optimizer_total}
    print(f"  {os.path.basename(path)}: Varuna.step {step_total / steps * 1e3:.1f} ms per step "
          f"(under the profiler), of which:")
    for k, v in groups.items():
        print(f"    {v / steps * 1e3:8.2f} ms/step  {k}")
    text = io.StringIO()
    pstats.Stats(path, stream=text).sort_stats("tottime").print_stats(top)
    lines = text.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    print("\n".join("    " + line for line in lines[start:start + top + 1]))


def main():
    if len(sys.argv) > 3 and sys.argv[1] == "--worker":
        return worker(sys.argv[3], sys.argv[2] == "profiled", sys.argv[4:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(bench.ROOT, "build"))
    p.add_argument("--size", default="small", choices=list(bench.SIZES))
    p.add_argument("--schedule", default="1f1b", choices=bench.SCHEDULES)
    p.add_argument("--rounds", type=int, default=3, help="unprofiled C++ and Python runs, interleaved")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    bench.check_python_package(args.build)
    cfg = bench.SIZES[args.size]
    steps = cfg["warmup"] + cfg["steps"]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(x for x in (os.path.join(args.build, "python"),
                                                      os.environ.get("PYTHONPATH")) if x))

    def run_python(out, mode):
        os.makedirs(out)
        cmd = [sys.executable, os.path.join(bench.ROOT, "scripts", "varuna_launch.py"), "--nstages", str(bench.P),
               "--chunk_size", str(cfg["chunk"]), "--batch_size", str(cfg["chunk"] * bench.M), "--",
               sys.executable, os.path.abspath(__file__), "--worker", mode, out, bench.PYTHON_TRAINER,
               "--steps", str(steps), "--d_model", str(cfg["d_model"]), "--layers", str(cfg["layers"]),
               "--heads", str(cfg["heads"]), "--seq_len", str(cfg["seq_len"]), "--schedule", args.schedule,
               "--clip", "0", "--threads", "1", "--log_every", "1000000"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)

    parts = {"cpp": [], "python": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for front_end in ["cpp", "python"][::1 if rnd % 2 == 0 else -1]:
                out = os.path.join(tmp, f"{front_end}{rnd}")
                if front_end == "cpp":
                    bench.run_ours(args.build, args.size, bench.P, args.schedule, out, "cpp")
                    files = [os.path.join(out, f"rank{r}_steps.jsonl") for r in range(bench.P)]
                else:
                    run_python(out, "plain")
                    files = [os.path.join(out, f"rank{r}_runtime.jsonl") for r in range(bench.P)]
                parts[front_end].append([breakdown(f, cfg["warmup"]) for f in files])
                line = "; ".join(f"rank {r}: " + " ".join(f"{k} {v * 1e3:6.1f}" for k, v in b.items())
                                 for r, b in enumerate(parts[front_end][-1]))
                print(f"[{args.size} {args.schedule} round {rnd}] {front_end:6s} ms/step {line}", flush=True)
        print("median over rounds, ms/step (Python - C++):")
        for r in range(bench.P):
            for k in ("step", "compute", "optimizer", "rest"):
                c = statistics.median(x[r][k] for x in parts["cpp"])
                py = statistics.median(x[r][k] for x in parts["python"])
                print(f"  rank {r} {k:9s} C++ {c * 1e3:7.1f}  Python {py * 1e3:7.1f}  ({(py - c) * 1e3:+6.1f})")
        ratios = [p[0]["step"] / c[0]["step"] for p, c in zip(parts["python"], parts["cpp"])]
        print("Python/C++ step time per round: " + ", ".join(f"{x:.3f}" for x in ratios)
              + f"; median {statistics.median(ratios):.3f}")
        prof = os.path.join(tmp, "prof")
        run_python(prof, "profiled")
        print(f"cProfile of the Python front end ({steps} steps, warm-up included):")
        for rank in range(bench.P):
            report(os.path.join(prof, f"rank{rank}.prof"), steps, args.top)


if __name__ == "__main__":
    main()
