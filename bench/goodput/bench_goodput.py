#!/usr/bin/env python3
"""bench/goodput: training goodput under a preemption trace, Varuna with and
without salvage against torchrun's elastic restarts.

Every side trains the example GPT (d_model 128, 4 blocks, 4 heads, seq 64,
one thread per worker) with a global batch of 48 on four loopback "hosts"
(127.0.0.1 .. 127.0.0.4, two slots each: 8 workers) while the bench replays
the same preemption trace against it:

  (a) salvage:    run_varuna with the plan AutoConfig chooses for the hosts
                  at hand at every launch (the bench profiles the model once
                  with profile_gpt and passes --profile; for this small model
                  it chooses pure data parallelism, 1 stage x 2 replicas a
                  host, as torchrun runs; --nstages 2 pins the earlier
                  rounds' 2 stages x as many replicas as the hosts allow,
                  micro-batch 4), periodic checkpoints every
                  --checkpoint_every steps, salvage on (its default);
  (b) no_salvage: the same with --no_salvage: a machine lost without notice
                  costs the steps since the last periodic checkpoint;
  (c) torchrun:   torchrun elastic (--nnodes 1:4, 2 workers a node) running
                  bench/goodput/peer_ddp.py: bench/morph's DDP peer, the same
                  GPT, data and global batch, rank 0 saving a checkpoint every
                  --checkpoint_every steps; every restart (a node lost, or a
                  node joining) resumes from that checkpoint. Its c10d
                  rendezvous store runs in a process of its own on the "head"
                  (as run_varuna does), so losing any host is survivable.

The trace (seeded; --seed, printed) is a list of machine events, each at a
time from the trace's start:
  - a preemption WITH notice: the host is announced --notice_s (30 s) before
    it goes. run_varuna hears it from notify_manager_preempt (deadline = the
    kill), as the cloud pollers (scripts/pollers/) would send it; the host's
    line leaves the machine list once the manager has the notice (the
    instance group no longer has it). torchrun has no notice path: it only
    sees the kill.
  - the kill: SIGKILL of every process of the host (the node agent and its
    workers) at once. For run_varuna its line leaves the machine list once
    the manager has seen the host lost (never before: a line removed first
    would be a graceful departure).
  - a return, a while later: the host's line is written back into the
    machine list (run_varuna starts its agent and grows the job), or a new
    torchrun node agent is started on it (torchrun restarts every worker to
    let it in).

The trace model (goodput_trace.py, whose docstring gives its sources)
follows published spot behaviour, with time compressed so that a 10-minute
run sees a busy day's worth of events: Poisson arrivals (mean gap
--mean_gap_s, 40 s), --notice_fraction (0.5) of them with a --notice_s (30 s)
notice, --bulk_fraction (0.2) taking two hosts at once, each lost host back
after an exponential time (mean --mean_out_s 60 s, at least --min_out_s 10
s), never the last --min_up (1) host taken.

Each side runs as one job: start, --warm_steps steps on all hosts, then
--baseline_s seconds fault-free (its fault-free throughput, periodic
checkpoints included), then --duration_s seconds of the trace, then the bench
waits until the job runs on every host the trace left up (so that a rollback
pending at the end is seen), and stops it. Figures per side:
  - samples kept: run_varuna's step reports (state dir: steps.jsonl and the
    resume_step of every launch in events.jsonl), the peer's rank 0 step
    and resume records; kept(t) = the lowest step reached at any time >= t
    (a step later rolled back and recomputed is not kept where it was first
    trained);
  - goodput = (kept(end) - steps done at the start) x global batch / the
    trace's duration (steps of the baseline that an event rolls back count
    against it); fault-free throughput = steps trained in the baseline window
    x global batch / its length; goodput_fraction = goodput / fault-free
    throughput.
On loopback every "host" shares the same 2 cores: a lost host takes away no
compute, and a smaller plan can even run faster than the full one (8
processes on 2 cores cost more than 4), so goodput_fraction can exceed 1: it
measures what the events cost (downtime, lost and recomputed steps,
restarts) plus the speed difference of the plans they force, never the lost
capacity a real cluster would also see. goodput_fraction_same_hosts takes
that difference out: kept steps over the steps the side would have trained
at its own steady rate on the hosts the trace leaves up at each moment
(steady rates per host count measured in this run, from every stretch of 5 s
or more of one generation of workers, start-up left out).

Sides are interleaved (all three per round, their order rotating by round),
the same trace in every round; figures are medians over the rounds. Prints
progress, a table, the plot's path (--out_dir/goodput.png: samples kept over
time per side, the trace's events marked), and as its last line one JSON
object: per side goodput and goodput_fraction (and more), the trace's seed
and counts, ratio_vs_torchrun = (a)'s goodput / (c)'s, and the targets.
ceiling_ratio_vs_torchrun puts in (a)'s place a run_varuna that the events
cost nothing (its steady rates on the hosts left, never a second down nor a
step lost): the most any elastic system with run_varuna's engine speeds could
reach against torchrun on this machine and trace.

    .venv/bin/python bench/goodput/bench_goodput.py [--duration_s 600] [--rounds 1] [--seed 1]
    .venv/bin/python bench/goodput/bench_goodput.py --smoke   # CI: 3 hosts, 20 s trace per side, not judged

The code: this file (command line, rounds), goodput_trace.py (the trace),
goodput_sides.py (the three jobs), goodput_replay.py (one side through one
round), goodput_measure.py (progress, kept samples, figures),
goodput_report.py (plot, table, JSON line), peer_ddp.py (the torchrun side's
worker); bench/common/ holds what bench/morph uses too.
"""
import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# Process, wait and clean-up helpers shared with bench/morph.
sys.path.insert(0, str(HERE.parent / "common"))
from bench_support import (BenchError, autoconfig_plan, make_log, pinned_plan, profile_gpt_argv,  # noqa: E402
                           require_built, run_guarded, tail, unwind_on_signals)
from goodput_replay import run_side  # noqa: E402
from goodput_report import plot, print_table, summary  # noqa: E402
from goodput_sides import SIDE_LABELS, SIDES  # noqa: E402
import goodput_trace  # noqa: E402
from goodput_trace import Trace  # noqa: E402

MODEL = ["--d_model", "128", "--layers", "4", "--heads", "4", "--seq_len", "64"]
SMOKE_MODEL = ["--d_model", "64", "--layers", "4", "--heads", "4", "--seq_len", "32"]  # bench/morph's: starts faster
PINNED_CHUNK = 4  # --nstages N: the micro-batch size, which divides every replica's share of 48
PROFILED_SIZES = "1,2,3,4,6,8,12"  # AutoConfig chooses among these micro-batch sizes
log = make_log("goodput")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, default=ROOT / "build")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv", help="has bin/torchrun (the pinned torch)")
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated, of: " + ", ".join(SIDES))
    parser.add_argument("--rounds", type=int, default=1, help="every side once per round, the same trace")
    parser.add_argument("--baseline_s", type=float, default=120, help="fault-free seconds before the trace")
    parser.add_argument("--hosts", type=int, default=4, help="loopback hosts 127.0.0.1 .. 127.0.0.N")
    parser.add_argument("--slots", type=int, default=2, help="workers per host")
    parser.add_argument("--nstages", type=int, default=0,
                        help="pin run_varuna's sides to this many stages (micro-batch %d); 0: AutoConfig plans "
                             "every launch from a profile the bench makes" % PINNED_CHUNK)
    parser.add_argument("--profile", type=Path, default=None,
                        help="AutoConfig's profile of the model (default: profile it into the work folder)")
    parser.add_argument("--checkpoint_every", type=int, default=60,
                        help="periodic checkpoint interval in steps, every side (~20 s fault-free here)")
    parser.add_argument("--warm_steps", type=int, default=5, help="steps on all hosts before the baseline starts")
    parser.add_argument("--timeout", type=float, default=180, help="deadline of every wait, seconds")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temp folder, removed at the end")
    parser.add_argument("--out_dir", type=Path, default=None, help="where goodput.png goes (default <workdir>/out, kept)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, events)")
    parser.add_argument("--smoke", action="store_true",
                        help="3 hosts, the small GPT, a 20 s hand-written trace per side (figures not judged)")
    goodput_trace.add_arguments(parser)
    args = parser.parse_args()
    args.model = MODEL
    if args.smoke:
        args.rounds, args.hosts, args.baseline_s, args.duration_s = 1, 3, 5, 20
        args.warm_steps, args.checkpoint_every, args.timeout = 3, 40, 120
        args.model = SMOKE_MODEL
    if args.nstages and args.profile:
        sys.exit("bench_goodput: --nstages pins the plan and --profile lets AutoConfig choose it: give one of them")
    if args.profile and not args.profile.is_file():
        sys.exit("bench_goodput: --profile %s does not exist (leave it out and the bench profiles the model)"
                 % args.profile)
    args.hosts = ["127.0.0.%d" % (i + 1) for i in range(args.hosts)]
    args.sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in args.sides if s not in SIDES]
    if unknown:
        sys.exit("bench_goodput: --sides: unknown %s (known: %s)" % (", ".join(unknown), ", ".join(SIDES)))
    require_built("bench_goodput", args.build, args.venv, "cmake --build build")
    return args


def profile_model(args, work):
    """profile_gpt on 2 processes, one thread each as the sides' workers run; returns the profile's
    path. About 3 s."""
    out = work / "profile"
    argv = profile_gpt_argv(args.build, out, PROFILED_SIZES, 10, [*args.model, "--threads", "1"])
    log("profiling the model for AutoConfig (micro-batch sizes %s)" % PROFILED_SIZES)
    start, log_path = time.monotonic(), work / "profile.log"
    with open(log_path, "w") as f:
        try:
            code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            raise BenchError("profiling the model took over %.0f s (--timeout); see %s" % (args.timeout, log_path))
    if code != 0:
        raise BenchError("profiling the model failed (%d):\n%s" % (code, tail(log_path)))
    log("profile written in %.0f s: %s" % (time.monotonic() - start, out / "profile.json"))
    return out / "profile.json"


def plan_flags(args, work):
    if args.nstages:
        return pinned_plan(args.nstages, PINNED_CHUNK)
    return autoconfig_plan(args.profile or profile_model(args, work))


def run_rounds(args, trace, work, per_side):
    """Every side once a round, the same trace, the order rotating by round so that no side always
    runs first (the machine's speed drifts)."""
    sides = args.sides
    for rnd in range(args.rounds):
        for name in sides[rnd % len(sides):] + sides[:rnd % len(sides)]:
            log("round %d: %s" % (rnd, SIDE_LABELS[name]))
            per_side[name].append(run_side(args, name, trace, rnd, work))


def main():
    args = parse_args()
    trace = Trace.smoke(args.hosts, args.duration_s) if args.smoke else Trace.from_args(args)
    log("trace seed %s: %s" % (trace.seed, json.dumps(trace.counts())))
    print(trace.describe(), flush=True)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    work.mkdir(parents=True, exist_ok=True)
    out_dir = args.out_dir or work / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    # Through the sides' clean-ups; SIGHUP stays ignored under nohup (a run of
    # ~40 minutes is often started that way).
    unwind_on_signals(keep_ignored=(signal.SIGHUP,))
    per_side = {s: [] for s in args.sides}

    def run():
        # args.plan: the plan flags every VarunaSide passes to run_varuna (inside the guard: a
        # profile that fails or hangs is cleaned up like any other step of the bench).
        if any(side != "torchrun" for side in args.sides):
            args.plan = plan_flags(args, work)
        run_rounds(args, trace, work, per_side)

    run_guarded(run, log, work, args.keep or args.workdir, spare=out_dir)

    png = out_dir / "goodput.png"
    plot(png, per_side, trace, args.slots)
    log("plot:", png)
    print_table(per_side, args.sides, args.rounds)
    # Last: the line smoke_test.py and readers of the figures take.
    print(json.dumps(summary(per_side, args.sides, trace, args, png)))


if __name__ == "__main__":
    main()
