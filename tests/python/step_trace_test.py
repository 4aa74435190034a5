#!/usr/bin/env python3
"""Step timelines (VarunaOptions::traceDir, train_gpt --trace_dir,
Varuna(trace_dir=...)) and scripts/pipeline_trace.py, on real 2-stage jobs:

  cpp_and_python       the C++ and the Python example under zbv each write one
                       trace per rank: every step holds its schedule's tasks
                       (F, BI, W of both chunks of each micro-batch, on the
                       virtual stages of the V), each inside its step; the
                       script merges them and splits the steps, and its replay
                       (free messages) never ends a rank's tasks later than
                       they ended
  cut_short            a trace whose last line a dying rank left half-written
                       still gives the steps before it
  refusals             no trace in the folder: exit 2 naming --trace_dir; a
                       trace folder that cannot be made: the job fails naming
                       trace_dir

    step_trace_test.py [name ...]
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.environ.get("VARUNA_SOURCE_DIR", os.path.dirname(os.path.dirname(HERE)))
BUILD = os.environ.get("VARUNA_BUILD_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "scripts"))
import checks  # noqa: E402
import pipeline_trace  # noqa: E402

failures = checks.failures
STEPS, MICROBATCHES = 3, 4
MODEL = ["--layers", "2", "--d_model", "32", "--heads", "2", "--seq_len", "16", "--schedule", "zbv",
         "--steps", str(STEPS), "--log_every", "1000"]
CPP = [os.path.join(BUILD, "examples", "gpt", "train_gpt")]
PY = [sys.executable, os.path.join(SOURCE, "examples", "python", "train_gpt.py")]
SCRIPT = os.path.join(SOURCE, "scripts", "pipeline_trace.py")


def launch(program, args):
    cmd = [sys.executable, os.path.join(SOURCE, "scripts", "varuna_launch.py"), "--nstages", "2",
           "--chunk_size", "2", "--batch_size", str(2 * MICROBATCHES), "--"] + program + MODEL + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def summary(trace_dir, *extra):
    proc = subprocess.run([sys.executable, SCRIPT, trace_dir, "--json"] + list(extra),
                          capture_output=True, text=True, timeout=120)
    return proc, (json.loads(proc.stdout) if proc.returncode == 0 else None)


def check_rank_trace(label, events, rank):
    """Every step: its schedule's tasks, each inside the step's span."""
    steps = {e["args"]["step"]: e for e in events if e.get("cat") == "step"}
    if sorted(steps) != list(range(1, STEPS + 1)):
        failures.append(f"{label} rank {rank}: steps {sorted(steps)}, expected 1..{STEPS}")
        return
    want_stages = {0: {0, 3}, 1: {1, 2}}[rank]  # zbv on 2 stages: the V
    for n, step in steps.items():
        tasks = [e for e in events if e.get("cat") == "task" and e["args"]["step"] == n]
        kinds = sorted((e["args"]["type"], e["args"]["virtual_stage"], e["args"]["microbatch"]) for e in tasks)
        expected = sorted((t, v, i) for t in ("F", "BI", "W") for v in want_stages for i in range(MICROBATCHES))
        if kinds != expected:
            failures.append(f"{label} rank {rank} step {n}: tasks {kinds}, expected {expected}")
        outside = [e["name"] for e in tasks
                   if e["dur"] < 0 or e["ts"] < step["ts"] or e["ts"] + e["dur"] > step["ts"] + step["dur"] + 1]
        if outside:
            failures.append(f"{label} rank {rank} step {n}: tasks outside the step's span: {outside}")
        waits = [e for e in events if e.get("cat") == "wait" and e["args"]["step"] == n]
        if rank == 1 and not any(e["name"] == "wait activation" for e in waits):
            failures.append(f"{label} rank 1 step {n}: no wait for an activation (its first forward has one)")


def check_replay_never_later(label, trace_dir):
    """The replay starts each task no later than it started (every message
    free), so it ends each rank's tasks no later than they ended."""
    events = [e for f in sorted(os.listdir(trace_dir)) if f.endswith("_trace.json") and "rank" in f
              for e in pipeline_trace.load_events(os.path.join(trace_dir, f))]
    for step, ranks in pipeline_trace.steps_of(events)[(0, 0)].items():
        origin = min(s["ts"] for s, _ in ranks.values())
        tasks = {r: sorted((e for e in evs if e["cat"] == "task"), key=lambda e: e["ts"]) for r, (_, evs) in ranks.items()}
        ends = pipeline_trace.replay(tasks)
        for r, t in tasks.items():
            actual = t[-1]["ts"] + t[-1]["dur"] - origin
            if ends[r] > actual + len(t):  # whole microseconds: one of rounding per task
                failures.append(f"{label} step {step} rank {r}: replay ends at {ends[r]} us, later than {actual}")


def traced_job(label, program, tmp):
    """Runs the job with a trace folder under tmp; the folder, or None (a failure noted)."""
    trace_dir = os.path.join(tmp, "trace")
    proc = launch(program, ["--trace_dir", trace_dir])
    if proc.returncode != 0:
        failures.append(f"{label}: job failed ({proc.returncode}): {checks.output_of(proc)}")
        return None
    return trace_dir


def check_traced_job(label, program):
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = traced_job(label, program, tmp)
        if trace_dir is None:
            return
        for rank in (0, 1):
            path = os.path.join(trace_dir, f"rank{rank}_trace.json")
            if not os.path.exists(path):
                failures.append(f"{label}: no {path}")
                return
            check_rank_trace(label, pipeline_trace.load_events(path), rank)
        check_replay_never_later(label, trace_dir)
        proc, out = summary(trace_dir)
        if out is None:
            failures.append(f"{label}: pipeline_trace.py failed ({proc.returncode}): {proc.stderr[-2000:]}")
            return
        with open(out["merged"]) as f:
            merged = json.load(f)
        if {e["pid"] for e in merged} != {0, 1}:
            failures.append(f"{label}: the merged trace's processes are {sorted({e['pid'] for e in merged})}")
        (pipeline,) = out["pipelines"]
        if pipeline["steps"] != list(range(2, STEPS + 1)):
            failures.append(f"{label}: summarised steps {pipeline['steps']}, expected 2..{STEPS} (--skip 1)")
        for r, row in pipeline["ranks"].items():
            shares = sum(row["shares"].values())  # each a median of its own: near 1
            if not (0 < row["busy_fraction"] <= 1 and 0 < row["replayed_busy_fraction"] <= 1.0 + 1e-9
                    and abs(shares - 1) < 0.1):
                failures.append(f"{label} rank {r}: implausible split {row}")


def test_cpp_and_python():
    check_traced_job("C++ train_gpt", CPP)
    check_traced_job("Python train_gpt", PY)


def test_cut_short():
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = traced_job("cut_short", CPP, tmp)
        if trace_dir is None:
            return
        for rank in (0, 1):  # each rank died writing its last step's events
            path = os.path.join(trace_dir, f"rank{rank}_trace.json")
            with open(path) as f:
                lines = f.read().splitlines()
            last_step = max(i for i, line in enumerate(lines) if '"cat":"step"' in line)  # it ends its step
            with open(path, "w") as f:
                f.write("\n".join(lines[:last_step]) + "\n" + lines[last_step][:40])
        proc, out = summary(trace_dir)
        if out is None:
            failures.append(f"cut_short: pipeline_trace.py failed ({proc.returncode}): {proc.stderr[-2000:]}")
        elif out["pipelines"][0]["steps"] != list(range(2, STEPS)):
            failures.append(f"cut_short: summarised steps {out['pipelines'][0]['steps']}, expected 2..{STEPS - 1}")


def test_refusals():
    with tempfile.TemporaryDirectory() as tmp:
        proc, _ = summary(tmp)
        if proc.returncode != 2 or "--trace_dir" not in proc.stderr:
            failures.append(f"an empty folder: exit {proc.returncode}, stderr {proc.stderr[-500:]!r}")
        # A stale rank file of a longer pipeline left in the folder: refused, not mixed in.
        trace_dir = traced_job("refusals", CPP, tmp)
        if trace_dir is not None:
            with open(os.path.join(trace_dir, "rank1_trace.json")) as f:
                stale = f.read().replace('"rank":1', '"rank":2').replace('"pid":1', '"pid":2')
            with open(os.path.join(trace_dir, "rank2_trace.json"), "w") as f:
                f.write(stale)
            proc, _ = summary(trace_dir)
            if proc.returncode != 2 or "different runs" not in proc.stderr:
                failures.append(f"a stale rank file: exit {proc.returncode}, stderr {proc.stderr[-500:]!r}")
        blocker = os.path.join(tmp, "a_file")
        with open(blocker, "w") as f:
            f.write("not a folder")
        proc = launch(CPP, ["--trace_dir", os.path.join(blocker, "trace")])
        if proc.returncode == 0 or "trace_dir" not in proc.stdout + proc.stderr:
            failures.append(f"a trace folder under a file: exit {proc.returncode}, {checks.output_of(proc, 800)}")


if __name__ == "__main__":
    checks.run(globals())
