#!/usr/bin/env python3
"""Where a pipeline step's time goes, from the runtime's step timelines.

Each rank of a job run with a trace folder (train_gpt --trace_dir DIR, the
Python front end's Varuna(..., trace_dir=DIR), VarunaOptions::traceDir)
writes DIR/rank<r>_trace.json (gen<g>_rank<r>_trace.json under run_varuna):
Chrome trace events of every step's tasks (F, R, B, BI, W), its waits on
neighbours, the posting of messages, the all-reduces and the update. This
script

  - merges them into one trace (DIR/trace.json; open it in ui.perfetto.dev
    or chrome://tracing: one track per rank, the steps side by side), and
  - splits each pipeline's step, median over the steps after --skip (each
    share a median of its own: together they are near 1, not exactly):
      tasks     the schedule's compute (what busy_fraction counts, with update)
      wait      blocked on a neighbour's message (the bubble, transfers, and
                a late neighbour)
      messages  posting sends and receives
      allreduce the data-parallel buckets and the step's exchange (waiting
                there for the slowest rank too)
      update    clipping, the optimizer, the loss scale
    and replays each rank's tasks in their order with their recorded
    durations and messages that cost nothing: the replay's busy fraction is
    the schedule's own bubble under this model's measured costs, and the
    difference to the measured one is what transfers, jitter between
    tasks and the runtime took.

    .venv/bin/python scripts/pipeline_trace.py DIR [--skip 1] [--json]

Exit status 2 (with the reason) when DIR holds no trace or a trace without
complete steps.
"""
import argparse
import glob
import json
import os
import statistics
import sys
from collections import defaultdict

CATEGORIES = ("tasks", "wait", "messages", "allreduce", "update")


def load_events(path):
    """A rank's events; its array is left open by the runtime. A rank that
    died while writing leaves a half line (dropped) and a last step without
    its "step" span, which the runtime writes last (left out by steps_of)."""
    with open(path) as f:
        text = f.read().rstrip()
    lines = [line.rstrip(",") for line in text.splitlines()[1:] if line.strip() not in ("", "]")]
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the line a dying rank left half-written; the steps before it stand
    return events


def steps_of(events):
    """{(generation, replica): {step: {rank: (step event, [its events])}}}.
    A step's events are those of its number inside its span: a program that
    loads a checkpoint and steps again numbers two steps alike, and the later
    one is kept."""
    out = defaultdict(lambda: defaultdict(dict))
    by_step = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e["cat"] != "step":
            by_step[(e["pid"], e["args"]["step"])].append(e)
    for e in events:
        if e.get("ph") == "X" and e["cat"] == "step":
            a = e["args"]
            inside = [x for x in by_step[(e["pid"], a["step"])] if e["ts"] <= x["ts"] <= e["ts"] + e["dur"]]
            out[(a["generation"], a["replica"])][a["step"]][a["rank"]] = (e, inside)
    return out


def check_one_pipeline(tasks_by_rank):
    """Each virtual stage on exactly one rank, all ranks of one model: else
    the folder mixes runs (a rank's file a longer pipeline left)."""
    owner, sizes = {}, set()
    for r, tasks in tasks_by_rank.items():
        for t in tasks:
            a = t["args"]
            sizes.add(a["virtual_stages"])
            if owner.setdefault(a["virtual_stage"], r) != r:
                raise ValueError(f"virtual stage {a['virtual_stage']} ran on ranks {owner[a['virtual_stage']]} and {r}: "
                                 "the folder mixes traces of different runs; give each run a folder of its own")
    if len(sizes) != 1 or sorted(owner) != list(range(next(iter(sizes)))):
        raise ValueError(f"the ranks' tasks cover virtual stages {sorted(owner)} of {sorted(sizes)}: the folder "
                         "mixes traces of different runs; give each run a folder of its own")


def dependencies(task):
    """The tasks (type, virtual stage, micro-batch) a task waits for."""
    a = task["args"]
    v, i, last = a["virtual_stage"], a["microbatch"], a["virtual_stages"] - 1
    if a["type"] == "F":
        return [("F", v - 1, i)] if v > 0 else []
    if a["type"] in ("B", "BI"):
        return [("B", v + 1, i)] if v < last else [("F", v, i)]
    if a["type"] == "W":
        return [("B", v, i)]
    return []  # R: recomputes from its own stored input


def replay(tasks_by_rank):
    """Each rank's tasks in their order with their recorded durations, every
    message free: each rank's end (microseconds from the step's start)."""
    pos = {r: 0 for r in tasks_by_rank}
    clock = {r: 0.0 for r in tasks_by_rank}
    done = {}
    moved = True
    while moved:
        moved = False
        for r, tasks in tasks_by_rank.items():
            while pos[r] < len(tasks):
                t = tasks[pos[r]]
                deps = dependencies(t)
                if any(d not in done for d in deps):
                    break
                clock[r] = max([clock[r]] + [done[d] for d in deps]) + t["dur"]
                a = t["args"]
                kind = "B" if a["type"] in ("B", "BI") else a["type"]
                done[(kind, a["virtual_stage"], a["microbatch"])] = clock[r]
                pos[r] += 1
                moved = True
    stuck = {r: p for r, p in pos.items() if p < len(tasks_by_rank[r])}
    if stuck:
        raise ValueError(f"the recorded order cannot be replayed (ranks stuck at tasks {stuck}): "
                         "a trace from a partial step or from ranks of different runs")
    return clock


def split_step(ranks):
    """One pipeline's step: per rank, its parts (microseconds) and busy
    fractions measured and replayed."""
    tasks = {r: sorted((e for e in evs if e["cat"] == "task"), key=lambda e: e["ts"]) for r, (_, evs) in ranks.items()}
    check_one_pipeline(tasks)
    ends = replay(tasks)
    longest = max(ends.values())
    rows = {}
    for r, (step, evs) in ranks.items():
        parts = dict.fromkeys(CATEGORIES, 0.0)
        for e in evs:
            parts["tasks" if e["cat"] == "task" else e["cat"]] += e["dur"]
        parts["other"] = max(0.0, step["dur"] - sum(parts.values()))
        busy = parts["tasks"] + parts["update"]
        rows[r] = {"step_us": step["dur"], "parts": parts,
                   "busy_fraction": busy / step["dur"],
                   "replayed_busy_fraction": busy / (longest + parts["update"])}
    return rows


def summarize(trace_dir, skip):
    files = sorted(glob.glob(os.path.join(trace_dir, "*rank*_trace.json")))
    if not files:
        raise ValueError(f"no rank*_trace.json in {trace_dir}: run the job with a trace folder "
                         "(train_gpt --trace_dir, Varuna(trace_dir=...))")
    events = [e for f in files for e in load_events(f)]
    pipelines = []
    for (generation, replica), steps in sorted(steps_of(events).items()):
        nranks = max(len(r) for r in steps.values())
        complete = sorted(s for s, r in steps.items() if len(r) == nranks)[skip:]
        if not complete:
            continue
        per_step = [split_step(steps[s]) for s in complete]
        ranks = sorted(per_step[0])
        med = lambda f: statistics.median(f(row) for row in per_step)  # noqa: E731
        rows = {r: {"step_ms": med(lambda row: row[r]["step_us"]) / 1000,
                    "shares": {k: med(lambda row: row[r]["parts"][k] / row[r]["step_us"])
                               for k in CATEGORIES + ("other",)},
                    "busy_fraction": med(lambda row: row[r]["busy_fraction"]),
                    "replayed_busy_fraction": med(lambda row: row[r]["replayed_busy_fraction"])} for r in ranks}
        pipelines.append({"generation": generation, "replica": replica, "steps": complete, "ranks": rows,
                          "busy_fraction": statistics.mean(v["busy_fraction"] for v in rows.values()),
                          "replayed_busy_fraction": statistics.mean(v["replayed_busy_fraction"] for v in rows.values())})
    if not pipelines:
        raise ValueError(f"no complete step after the first {skip} in {trace_dir}")
    return events, pipelines


def print_table(pipelines):
    for p in pipelines:
        gen = f"generation {p['generation']}, " if p["generation"] else ""
        print(f"{gen}replica {p['replica']}: steps {p['steps'][0]}-{p['steps'][-1]}, medians")
        print("rank  step_ms  " + "  ".join(f"{k:>9}" for k in CATEGORIES + ("other",)) + "   busy  replayed")
        for r, v in p["ranks"].items():
            shares = "  ".join(f"{v['shares'][k]:9.3f}" for k in CATEGORIES + ("other",))
            print(f"{r:4d} {v['step_ms']:8.1f}  {shares}  {v['busy_fraction']:.3f}  {v['replayed_busy_fraction']:.3f}")
        print(f"busy fraction {p['busy_fraction']:.3f} measured, {p['replayed_busy_fraction']:.3f} replayed with "
              f"these task times and free messages: the schedule's own bubble is "
              f"{1 - p['replayed_busy_fraction']:.1%} of the step, transfers, jitter and the runtime took "
              f"{p['replayed_busy_fraction'] - p['busy_fraction']:.1%}\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--skip", type=int, default=1, help="leave out the first N steps (shape learning, allocation)")
    parser.add_argument("--merged", help="where the merged trace goes (default: TRACE_DIR/trace.json)")
    parser.add_argument("--json", action="store_true", help="print the split as JSON instead of a table")
    args = parser.parse_args()
    try:
        events, pipelines = summarize(args.trace_dir, args.skip)
    except ValueError as e:
        print(f"pipeline_trace: {e}", file=sys.stderr)
        return 2
    merged = args.merged or os.path.join(args.trace_dir, "trace.json")
    with open(merged, "w") as f:
        json.dump(events, f)
    if args.json:
        print(json.dumps({"merged": merged, "pipelines": pipelines}, indent=1))
    else:
        print_table(pipelines)
        print(f"merged trace: {merged} (ui.perfetto.dev or chrome://tracing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
