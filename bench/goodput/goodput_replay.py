"""bench/goodput: one side through one round: start the job, warm it up,
its fault-free baseline, the trace replayed against it, the wait until it
runs on every host left, the stop; then its figures (goodput_measure)."""
import json
import time

import bench_support
from bench_support import BenchError, describe, make_log, wait_for
from goodput_measure import CpuMonitor, side_figures
from goodput_sides import GLOBAL_BATCH, TorchrunSide, VarunaSide

POLL_S = 0.1  # the bench's own polling: it shares the 2 cores with the jobs it measures
STALL_S = 5.0  # a replay loop that did not run for this long could not keep the trace's times
log = make_log("goodput")


def wait_until(t_unix, service):
    """Runs service() until the Unix time t_unix (a time of the trace, not a synchronisation).
    A loop that did not run for STALL_S (the bench stopped by a signal from outside, or a
    machine too overloaded to replay the trace on time) voids the run: it raises."""
    last = time.monotonic()
    while True:
        service()
        now = time.monotonic()
        if now - last > STALL_S:
            raise BenchError("the bench did not run for %.0f s (stopped by a signal, or the machine overloaded): "
                             "the trace was not replayed on time, the figures would be void" % (now - last))
        last = now
        left = t_unix - time.time()
        if left <= 0:
            return
        time.sleep(min(POLL_S, left))


def replay(side, name, trace, t0, tick):
    """Replays the trace's actions at t0 + their times. Returns them as replayed (Unix time, kind,
    host, notice) and the Unix time of the last one the side must absorb (a notice for run_varuna,
    which morphs on it; a kill it had no notice of; a return)."""
    done, last = [], 0.0
    for t, kind, host, notice in trace.actions:
        wait_until(t0 + t, tick)
        if kind == "notice":
            side.notice(host, t0 + t + trace.notice_s)
            if name != "torchrun":
                last = time.time()
        elif kind == "kill":
            n = side.kill(host, notice)
            if name == "torchrun" or not notice:
                last = time.time()
            log("%s: %5.1f s %s killed (%d processes)%s" % (name, time.time() - t0, host, n,
                                                          " after its notice" if notice else ", no notice"))
        else:
            side.back(host)
            last = time.time()
            log("%s: %5.1f s %s returns" % (name, time.time() - t0, host))
        done.append((time.time(), kind, host, notice))
    return done, last


def drive(side, name, args, trace, cpu):
    """Runs the side through the round; returns its Unix times (warm, t0, end, settled) and the
    actions as replayed."""
    def tick():
        side.service()
        cpu.sample()

    t_start = time.time()
    side.start()
    wait_for("%s: %d steps on all %d hosts (%s)" % (name, args.warm_steps, len(args.hosts), side.dir),
             lambda: side.running_on(args.hosts, 0, args.warm_steps), args.timeout, POLL_S)
    t_warm = time.time()
    log("%s: training on all hosts %.1f s after its start; %.0f s fault-free, then the trace"
        % (name, t_warm - t_start, args.baseline_s))
    t0 = t_warm + args.baseline_s
    wait_until(t0, tick)
    done, last = replay(side, name, trace, t0, tick)
    t_end = t0 + args.duration_s
    wait_until(t_end, tick)
    up = sorted(trace.up_at_end())
    # A rollback pending at the end (a host lost just before it) is part of the
    # result: wait until the job runs again on every host that is up.
    wait_for("%s to run on %s after the trace's last event" % (name, ", ".join(up)),
             lambda: side.running_on(up, last), args.timeout, POLL_S)
    times = {"warm": t_warm, "t0": t0, "end": t_end, "settled": time.time()}
    cpu.sample(force=True)
    side.stop()
    return times, done


def run_side(args, name, trace, rnd, work):
    """One side, one round: its figures (goodput_measure.side_figures) and the actions as replayed."""
    side = (TorchrunSide if name == "torchrun" else VarunaSide)(args, name, rnd, work)
    cpu = CpuMonitor()
    try:
        times, done = drive(side, name, args, trace, cpu)
    finally:
        left = bench_support.kill_leftovers(log)
        side.cleanup()
        if left:
            raise BenchError("processes still alive after SIGKILL: %s" % describe(left))
    side.check()
    result = side_figures(side, trace, times, GLOBAL_BATCH, cpu)
    result["actions"] = [(t - times["t0"], kind, host, notice) for t, kind, host, notice in done]
    result["plans"] = side.plans()
    log("%s: goodput %.1f samples/s = %.3f of its fault-free %.1f (%.3f of its steady rates on the hosts left); "
        "%.0f steps kept, %.0f rolled back, %d restarts; steady samples/s by hosts: %s"
        % (name, result["goodput"], result["goodput_fraction"] or 0, result["fault_free_samples_per_s"],
           result["goodput_fraction_same_hosts"] or 0, result["steps_kept"], result["steps_rolled_back"],
           result["restarts"], ", ".join("%d: %.0f" % kv for kv in result["steady_samples_per_s_by_hosts"].items())))
    log("%s: plans launched (how many times): %s" % (name, json.dumps(result["plans"])))
    log("%s: other processes used %.2f cores on average meanwhile (the side's own: %.2f)"
        % (name, result["others_cpu_cores"], result["own_cpu_cores"]))
    return result
