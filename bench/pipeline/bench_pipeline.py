#!/usr/bin/env python3
"""bench/pipeline: Varuna's pipeline runtime against torch.distributed.pipelining.

Runs the example GPT at P=2 stages (--stages), D=1, m=8 micro-batches, one thread per
process, at two sizes, and in the same run the peer (every schedule of
torch.distributed.pipelining in the same torch wheel: 1F1B, GPipe,
Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, the last
four with two stages per rank; same model, weights, data and thread
settings), and our Python front end: examples/python/train_gpt.py, the
same GPT written in Python (initial weights bit for bit the C++ example's,
checked), trained on the same engine with the same settings. Prints a table,
then as its last line one JSON object:

  {"small": {"tokens_per_s", "peer_tokens_per_s", "ratio_vs_peer" (over the
             peer's best schedule), "bubble_bound", "efficiency", "busy_fraction", ...,
             "python": {"tokens_per_s", "ratio_vs_peer", "step_time_over_cpp", ...}},
   "medium": {...}}

efficiency = single-process step time / (P x pipelined step time), for the best
of our schedules; bubble_bound = m / (m + P - 1), 1F1B's; busy_bound, per
schedule, its busy fraction with equal task costs and no optimizer.
busy_fraction (per schedule of ours): each stage's compute time inside a step
(its tasks: forward, recompute, backward or its B and W halves; and its
optimizer step; as the runtime measures them) over its step time, averaged
over stages: one minus the schedule's own bubble and the runtime's own time,
however well the machine runs P processes at once (which efficiency also
measures). step_parts splits each step into tasks, optimizer, wait (blocked
on a neighbour's message: bubble and transfers; the runtime's wait_s) and
other (posting messages, the step's exchange, bookkeeping); "tasks" alone is
the fraction earlier runs reported as busy_fraction. step_peak_memory_mib (ours, per schedule) and
peer_step_peak_memory_mib: the worst stage's peak resident memory during a
step over its size at the step's start (Linux VmHWM reset at the start, after
glibc's malloc_trim handed the heap's free memory back), i.e. activations and
the step's other temporaries; measured on the warm-up steps after the first
(the trim slows a step; the first allocates AdamW's state): the median of
those, one step at the medium size, two at the small. For the Python front end,
ratio_vs_peer = its tokens/s (best schedule) over the peer's best, and
step_time_over_cpp = its step time over the C++ example's with the same
(the Python side's best) schedule.

This machine's speed drifts by tens of percent within minutes (shared VM), so
every configuration (ours x 6 schedules in C++ and in Python, single process,
peer x 6) runs once per round, the rounds interleave them, and each figure is
the best of the rounds' median step times. Each schedule's C++ and Python runs
are next to each other in time, their order alternating by round.

    .venv/bin/python bench/pipeline/bench_pipeline.py [--build build] [--sizes small,medium] [--rounds 3] [--no_python]
    .venv/bin/python bench/pipeline/bench_pipeline.py --smoke   # does it still run? (seconds, not judged)

--smoke runs one round at a tiny size (d_model 32, 2 blocks, seq 16, 1
warm-up + 2 timed steps) with one schedule per side (ours 1f1b in C++ and in
Python, the peer's 1F1B) and the single process: the same table and JSON
line without "targets", figures meaningless. CTest runs it (label bench) so
that a bench that no longer runs fails CI; interpreters importing torch (the
peer's, the Python front end's) are most of its time.

profile_python_row.py, next to this file, shows where the Python front end's
step time goes against the C++ example's.
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
    # --smoke: does the bench still run (figures meaningless)
    "tiny": dict(d_model=32, layers=2, heads=2, seq_len=16, chunk=1, warmup=1, steps=2),
}
P, M = 2, 8
# ours; 1f1b must be there: the peer loads its initial weights
SCHEDULES = ["varuna", "1f1b", "gpipe", "zb-h1", "interleaved", "zbv"]


def busy_bound(schedule):
    """The schedule's busy fraction with equal task costs and free transfers (None: no closed form)."""
    if schedule in ("1f1b", "gpipe"):
        return M / (M + P - 1)  # forward F, backward 2F: (P-1)(F+B) idle
    if schedule == "zb-h1":
        return 3 * M / (3 * M + 2 * (P - 1) - 1)  # F = B = W: (P-1)(F+B) - W idle (common/schedule.h)
    if schedule == "interleaved":
        return M / (M + (P - 1) / 2)  # two chunks per stage: (P-1)(F+B)/2 idle
    if schedule == "zbv" and P == 2:
        return 3 * M / (3 * M + 0.5)  # the list-scheduled order's replay (schedule_test.cpp), F = B = W
    return None  # varuna: recompute changes the work per stage
PEER_SCHEDULES = ["1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
PYTHON_TRAINER = os.path.join(ROOT, "examples", "python", "train_gpt.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import pipeline_trace  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ours(build, size, stages, schedule, dump, front_end="cpp"):
    """Median step time of our train_gpt: the C++ example, or with front_end
    "python" the Python one (the varuna package of `build`) with the same options."""
    cfg = SIZES[size]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if front_end == "python":
        program = [sys.executable, PYTHON_TRAINER]
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(build, "python"), env.get("PYTHONPATH")) if p)
    else:
        program = [os.path.join(build, "examples", "gpt", "train_gpt"), "--log_level", "warn"]
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "varuna_launch.py"), "--nstages", str(stages),
           "--chunk_size", str(cfg["chunk"]), "--batch_size", str(cfg["chunk"] * M), "--"] + program + [
           "--steps", str(cfg["warmup"] + cfg["steps"]),
           "--d_model", str(cfg["d_model"]), "--layers", str(cfg["layers"]), "--heads", str(cfg["heads"]),
           "--seq_len", str(cfg["seq_len"]), "--schedule", schedule, "--clip", "0", "--threads", "1",
           "--dump_dir", dump, "--log_every", "1000000"]
    if front_end == "cpp":
        cmd += ["--probe_memory_steps", str(cfg["warmup"])]  # warm-up steps only: the probe slows a step
        cmd += ["--trace_dir", os.path.join(dump, "trace")]  # for busy_fraction_replayed
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    with open(os.path.join(dump, "rank0_steps.jsonl")) as f:
        times = [json.loads(line)["time_s"] for line in f]
    return statistics.median(times[cfg["warmup"]:])


def step_memory(dump, stages, warmup):
    """The largest, over the stages, median step peak of resident memory over
    the step's start (activations and every other temporary of a step)."""
    worst = 0
    for rank in range(stages):
        with open(os.path.join(dump, f"rank{rank}_steps.jsonl")) as f:
            rows = [json.loads(line) for line in f][1:warmup]  # the first step also allocates AdamW's state
        peaks = [r["step_peak_rss_over_start_bytes"] for r in rows if "step_peak_rss_over_start_bytes" in r]
        if not peaks:
            return None
        worst = max(worst, statistics.median(peaks))
    return worst


def step_parts(dump, stages, warmup):
    """Where each stage's step time goes, as fractions of it (median over the
    timed steps, averaged over stages): "tasks" (forward, recompute,
    backward or B and W), "optimizer", "wait" (blocked on a neighbour's
    message: the bubble and transfers) and "other" (the rest: posting
    messages, the step's exchange, bookkeeping). None without the runtime's
    timings."""
    sums = {"tasks": 0.0, "optimizer": 0.0, "wait": 0.0, "other": 0.0}
    for rank in range(stages):
        with open(os.path.join(dump, f"rank{rank}_steps.jsonl")) as f:
            rows = [json.loads(line) for line in f][warmup:]
        if not rows or "wait_s" not in rows[0]:
            return None
        parts = {"tasks": [r["compute_s_per_microbatch"] * M / r["time_s"] for r in rows],
                 "optimizer": [r["optimizer_s"] / r["time_s"] for r in rows],
                 "wait": [r["wait_s"] / r["time_s"] for r in rows]}
        medians = {k: statistics.median(v) for k, v in parts.items()}
        medians["other"] = max(0.0, 1.0 - sum(medians.values()))
        for k, v in medians.items():
            sums[k] += v / stages
    return sums


def busy_fraction(dump, stages, warmup):
    """The share of a stage's step time spent computing (its tasks and its
    optimizer step), averaged over stages; None without the runtime's
    timings. What stays is waiting on neighbours (the bubble) and the
    runtime's own time."""
    parts = step_parts(dump, stages, warmup)
    return None if parts is None else parts["tasks"] + parts["optimizer"]


def replayed_busy_fraction(dump, warmup):
    """busy_fraction with each rank's recorded tasks replayed in their order
    and messages free (scripts/pipeline_trace.py): the schedule's own bubble
    under this run's task costs, without transfers and jitter."""
    _, pipelines = pipeline_trace.summarize(os.path.join(dump, "trace"), warmup)
    return pipelines[0]["replayed_busy_fraction"]


def run_peer(size, schedule, weights):
    cfg = SIZES[size]
    port = free_port()
    procs = []
    for rank in range(P):
        cmd = [sys.executable, os.path.join(HERE, "peer_pipelining.py"), "--rank", str(rank), "--ranks", str(P),
               "--port", str(port),
               "--schedule", schedule, "--d_model", str(cfg["d_model"]), "--layers", str(cfg["layers"]),
               "--heads", str(cfg["heads"]), "--seq_len", str(cfg["seq_len"]), "--batch", str(cfg["chunk"] * M),
               "--microbatches", str(M), "--warmup", str(cfg["warmup"]), "--steps", str(cfg["steps"]),
               "--weights", weights]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env))
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"peer {schedule} failed")
    # Every rank prints its memory; the rank holding the last stage (rank P-1,
    # or rank 0 in a V) its step time too.
    rows = [json.loads(line) for out in outputs for line in out.strip().splitlines() if line.startswith("{")]
    step_time = [r["step_time_s"] for r in rows if "step_time_s" in r][-1]
    return step_time, max(r["step_peak_rss_over_start_bytes"] for r in rows)


def check_python_package(build):
    package = os.path.join(build, "python", "varuna")
    if not any(f.startswith("_C.") for f in (os.listdir(package) if os.path.isdir(package) else [])):
        sys.exit(f"bench_pipeline: no varuna package (its _C extension) in {package}: build it "
                 f"(VARUNA_BUILD_PYTHON=ON, target varuna_python) or pass --no_python to leave the Python row out")


def check_same_initial_weights(cpp_dump, python_dump):
    """Both front ends start from the same parameters, bit for bit, on every stage
    (the peer loads the C++ example's, so all three do)."""
    import torch  # here only: the rest of the bench runs without it

    for rank in range(P):
        name = f"rank{rank}_initial.pt"
        cpp, python = (torch.load(os.path.join(d, name)) for d in (cpp_dump, python_dump))
        differ = sorted(set(cpp) ^ set(python)) or [k for k in cpp if not torch.equal(cpp[k], python[k])]
        if differ:
            raise RuntimeError(f"rank {rank}: the Python front end's initial parameters differ from the C++ "
                               f"example's in {', '.join(differ[:5])}")


def verdict(figures, target):
    if "targets" not in figures:
        return "not judged"
    return "met" if figures["targets"][target] else "MISSED"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--sizes", default="small,medium")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", type=int, default=2,
                        help="pipeline stages P (one process each, one thread: P=4 wants 4 free cores)")
    parser.add_argument("--small_chunk", type=int, default=None,
                        help="micro-batch size of the small model (default 4; 1 stresses per-micro-batch overhead)")
    parser.add_argument("--smoke", action="store_true",
                        help="one round at a tiny size (seconds; figures not judged): does the bench still run?")
    parser.add_argument("--no_python", action="store_true",
                        help="leave out the Python front end (a build without the varuna package)")
    args = parser.parse_args()
    global P
    P = args.stages
    if not args.no_python:
        check_python_package(args.build)
    if args.smoke:
        args.sizes, args.rounds = "tiny", 1
        SCHEDULES[:], PEER_SCHEDULES[:] = ["1f1b"], ["1F1B"]
    if args.small_chunk:
        SIZES["small"].update(chunk=args.small_chunk, warmup=5, steps=30)
    result = {}
    for size in args.sizes.split(","):
        cfg = SIZES[size]
        tokens = cfg["chunk"] * M * cfg["seq_len"]
        ours, python, peer, single = {}, {}, {}, float("inf")
        busy = {}  # ours (C++), per schedule: busy_fraction of its best round
        replayed = {}  # ours (C++), per schedule: the same round's busy_fraction replayed with free messages
        parts = {}  # ours (C++), per schedule: step_parts of its best round
        memory, peer_memory = {}, {}  # per schedule: a step's peak host memory (bytes) of its best round
        paired = {s: [] for s in SCHEDULES}  # per round: Python step time / C++ step time
        for rnd in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                for schedule in SCHEDULES:
                    front_ends = ["cpp"] if args.no_python else ["cpp", "python"][::1 if rnd % 2 == 0 else -1]
                    times = {}
                    for front_end in front_ends:
                        dump = os.path.join(tmp, schedule if front_end == "cpp" else f"python_{schedule}")
                        t = times[front_end] = run_ours(args.build, size, P, schedule, dump, front_end)
                        table = ours if front_end == "cpp" else python
                        busy_now = busy_fraction(dump, P, cfg["warmup"]) if front_end == "cpp" else None
                        if front_end == "cpp" and t < table.get(schedule, float("inf")):
                            busy[schedule] = busy_now
                            replayed[schedule] = replayed_busy_fraction(dump, cfg["warmup"])
                            parts[schedule] = step_parts(dump, P, cfg["warmup"])
                            memory[schedule] = step_memory(dump, P, cfg["warmup"])
                        table[schedule] = min(table.get(schedule, t), t)
                        label = "ours" if front_end == "cpp" else "ours Python"
                        print(f"[{size} round {rnd}] {label:11s} {schedule:7s} P={P}: {t*1e3:8.1f} ms/step"
                              + (f", busy {busy_now:.3f}" if busy_now is not None else ""), flush=True)
                    if "python" in times:
                        paired[schedule].append(times["python"] / times["cpp"])
                        if rnd == 0:
                            check_same_initial_weights(os.path.join(tmp, schedule),
                                                       os.path.join(tmp, f"python_{schedule}"))
                    if schedule == "1f1b":  # peers next to ours in time
                        for peer_schedule in PEER_SCHEDULES:
                            try:
                                t, peak = run_peer(size, peer_schedule, os.path.join(tmp, "1f1b"))
                            except (RuntimeError, IndexError, ValueError) as error:  # a torch whose schedule breaks
                                print(f"[{size} round {rnd}] peer {peer_schedule:6s} P={P}: failed ({error})", flush=True)
                                continue
                            if t < peer.get(peer_schedule, float("inf")):
                                peer_memory[peer_schedule] = peak
                            peer[peer_schedule] = min(peer.get(peer_schedule, t), t)
                            print(f"[{size} round {rnd}] peer {peer_schedule:6s} P={P}: {t*1e3:8.1f} ms/step", flush=True)
                t = run_ours(args.build, size, 1, "1f1b", os.path.join(tmp, "single"))
                single = min(single, t)
                print(f"[{size} round {rnd}] ours single process: {t*1e3:8.1f} ms/step", flush=True)
        if not peer:
            sys.exit(f"bench_pipeline: every peer schedule failed at the {size} size (their errors are above)")
        best = min(ours, key=ours.get)
        best_peer = min(peer, key=peer.get)
        result[size] = {
            "config": {k: cfg[k] for k in ("d_model", "layers", "seq_len", "chunk")} | {"P": P, "m": M,
                                                                                         "rounds": args.rounds},
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
            "busy_fraction": busy,
            "busy_bound": {s: busy_bound(s) for s in busy},
            "busy_fraction_replayed": replayed,
            "step_parts": parts,
            # The worst stage's median step peak of resident memory over the step's start:
            # activations and every other temporary of a step (weights, gradients and
            # optimizer state are there before it starts), ours and the peer's.
            "step_peak_memory_mib": {s: v / 2**20 for s, v in memory.items() if v is not None},
            "peer_step_peak_memory_mib": {s: v / 2**20 for s, v in peer_memory.items() if v >= 0},
            "targets": {"busy_fraction>=0.95": max((v for v in busy.values() if v is not None), default=0) >= 0.95,
                        "ratio_vs_peer>=1.05": peer[best_peer] / ours[best] >= 1.05},
        }
        r = result[size]
        print(f"[{size}] tokens/s ours {r['tokens_per_s']:.0f} ({best}) vs peer {r['peer_tokens_per_s']:.0f} "
              f"({best_peer}, the best of its {len(peer)} schedules): ratio {r['ratio_vs_peer']:.2f}; efficiency "
              f"{r['efficiency']:.3f} (bubble bound {r['bubble_bound']:.3f}); busy fraction (analytic bound) "
              + ", ".join(f"{k} {v:.3f} ({r['busy_bound'][k] or float('nan'):.3f})" for k, v in busy.items()
                          if v is not None), flush=True)
        print(f"[{size}] busy fraction replayed with free messages (the schedule's own bubble under the measured "
              "task costs): " + ", ".join(f"{k} {v:.3f}" for k, v in replayed.items()), flush=True)
        print(f"[{size}] step parts (tasks / optimizer / wait / other): "
              + ", ".join(f"{k} " + " / ".join(f"{v[p]:.3f}" for p in ("tasks", "optimizer", "wait", "other"))
                          for k, v in parts.items() if v is not None), flush=True)
        print(f"[{size}] step peak memory (MiB, worst stage): ours "
              + ", ".join(f"{k} {v:.1f}" for k, v in r["step_peak_memory_mib"].items()) + "; peer "
              + ", ".join(f"{k} {v:.1f}" for k, v in r["peer_step_peak_memory_mib"].items()), flush=True)
        if args.smoke:
            del r["targets"]
        if python:
            best_py = min(python, key=python.get)
            r["python"] = py = {
                "tokens_per_s": tokens / python[best_py],
                "best_schedule": best_py,
                "step_s": python,
                "ratio_vs_peer": peer[best_peer] / python[best_py],
                "step_time_over_cpp": python[best_py] / ours[best_py],
                "step_time_over_cpp_per_schedule": {s: python[s] / ours[s] for s in python},
                "step_time_over_cpp_best": python[best_py] / ours[best],  # each side's best schedule
                # the same ratio taken within each round (the runs next to each other in time)
                "step_time_over_cpp_paired_median": {s: statistics.median(v) for s, v in paired.items() if v},
                "same_initial_weights": True,  # checked, or the bench has failed
                "targets": {"ratio_vs_peer>=1.05": peer[best_peer] / python[best_py] >= 1.05,
                            "step_time_over_cpp<=1.10": python[best_py] / ours[best_py] <= 1.10},
            }
            if args.smoke:
                del py["targets"]
            print(f"[{size}] Python front end: tokens/s {py['tokens_per_s']:.0f} ({best_py}): ratio vs peer "
                  f"{py['ratio_vs_peer']:.2f} (target >= 1.05: {verdict(py, 'ratio_vs_peer>=1.05')}); step time "
                  f"over C++ {best_py} {py['step_time_over_cpp']:.3f} (target <= 1.10: "
                  f"{verdict(py, 'step_time_over_cpp<=1.10')})", flush=True)
    if args.smoke:
        result["smoke"] = True
    print(json.dumps(result))


if __name__ == "__main__":
    main()
