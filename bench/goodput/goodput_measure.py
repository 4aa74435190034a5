"""bench/goodput's measurements: a side's progress over time (steps done, and
the steps kept: never rolled back later), its steady rates per host count,
the steps it would have trained at those rates on the hosts the trace left,
the CPU others used meanwhile, and from all that one side's figures.
"""
import bisect
import json
import math
import os
import time
from pathlib import Path

from bench_support import MARKER

MIN_SEGMENT_S = 5.0  # a stretch of steady training shorter than this says little about a rate


class JsonlTail:
    """The JSON lines appended to a file since the last call (a line being written waits)."""

    def __init__(self, path):
        self.path, self.offset, self.partial = Path(path), 0, b""

    def new(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


class CpuMonitor:
    """CPU time of this machine's other processes (not the bench's, found by its marker) while a
    side runs: how much others' work competed with it for the 2 cores. Samples every 2 s; a
    process that starts and ends between two samples is missed."""

    def __init__(self):
        self.tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            self.since = float(f.read().split()[0]) * self.tick  # processes started later count whole
        self.needle = MARKER.encode() + b"\0"
        self.cpu, self.mine = {}, {}
        self.others = self.ours = 0.0
        self.start, self.next = time.monotonic(), 0.0
        self.sample(force=True)
        self.others = self.ours = 0.0  # what ran before the start is not the side's

    def sample(self, force=False):
        now = time.monotonic()
        if now < self.next and not force:
            return
        self.next = now + 2.0
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                self._account(int(entry.name))

    def _account(self, pid):
        try:
            with open("/proc/%d/stat" % pid) as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            cpu, started = int(fields[11]) + int(fields[12]), int(fields[19])  # utime + stime, starttime
        except (OSError, ValueError, IndexError):
            return
        key = (pid, started)  # a pid reused by a later process is another process
        if key not in self.mine:
            self.mine[key] = pid == os.getpid() or self._marked(pid)
        before = self.cpu.get(key, 0 if started > self.since else cpu)
        self.cpu[key] = cpu
        if self.mine[key]:
            self.ours += (cpu - before) / self.tick
        else:
            self.others += (cpu - before) / self.tick

    def _marked(self, pid):
        try:
            with open("/proc/%d/environ" % pid, "rb") as f:
                return self.needle in f.read()
        except OSError:
            return False

    def cores(self):
        """(others' cores, ours) on average since the start."""
        wall = time.monotonic() - self.start
        return self.others / wall, self.ours / wall


class Progress:
    """A job's progress (steps done) over time, from points (Unix time, steps done, segment)
    sorted by time: step records, and each (re)start at the step it resumed from. Within one
    segment (a generation, a worker process) it is interpolated between step records, else held."""

    def __init__(self, points):
        self.t = [p[0] for p in points]
        self.v = [p[1] for p in points]
        self.seg = [p[2] for p in points]
        self.suffix_min = list(self.v)  # suffix_min[i] = min(v[i:])
        for i in range(len(self.v) - 2, -1, -1):
            self.suffix_min[i] = min(self.v[i], self.suffix_min[i + 1])

    def value_at(self, t):
        i = bisect.bisect_right(self.t, t)
        if i == 0:
            return self.v[0] if self.v else 0
        p = i - 1
        if i < len(self.t) and self.seg[i] == self.seg[p] and self.v[i] >= self.v[p] and self.t[i] > self.t[p]:
            return self.v[p] + (self.v[i] - self.v[p]) * (t - self.t[p]) / (self.t[i] - self.t[p])
        return self.v[p]

    def kept_at(self, t):
        """Steps kept at t: the progress at t, or less if a later rollback went below it."""
        i = bisect.bisect_right(self.t, t)
        value = self.value_at(t)
        return min(value, self.suffix_min[i]) if i < len(self.t) else value

    def trained_between(self, t0, t1):
        """Steps trained in [t0, t1], kept or not: the sum of the progress's increases."""
        lo, hi = bisect.bisect_right(self.t, t0), bisect.bisect_left(self.t, t1)
        values = [self.value_at(t0)] + self.v[lo:hi] + [self.value_at(t1)]
        return sum(max(0.0, b - a) for a, b in zip(values, values[1:]))


def steady_rates(segments, t_from, t_to):
    """Steps per second by host count: steps over time of every stretch of steady training
    (one generation or worker group, start-up left out) at least MIN_SEGMENT_S long."""
    steps, seconds = {}, {}
    for n, points in segments:
        points = [p for p in points if t_from <= p[0] <= t_to]
        if len(points) >= 2 and points[-1][0] - points[0][0] >= MIN_SEGMENT_S:
            steps[n] = steps.get(n, 0) + (points[-1][1] - points[0][1])
            seconds[n] = seconds.get(n, 0) + (points[-1][0] - points[0][0])
    return {n: steps[n] / seconds[n] for n in steps}


def expected_steps(rates, trace, fallback):
    """Steps a side would train over the trace at its steady rate on the hosts the trace leaves
    up at each moment (a host counts until it is killed). A host count the side never trained
    steadily on takes the rate of the nearest count it did, else the fault-free rate."""
    def rate(n):
        if n in rates:
            return rates[n]
        known = sorted(rates, key=lambda k: (abs(k - n), -k))
        return rates[known[0]] if known else fallback

    spans = trace.hosts_up()
    ends = [t for t, _ in spans[1:]] + [trace.duration_s]
    return sum(rate(n) * (end - t) for (t, n), end in zip(spans, ends))


def frange(a, b, step):
    n = int(math.floor((b - a) / step))
    return [a + i * step for i in range(n + 1)] + [b]


def side_figures(side, trace, times, global_batch, cpu):
    """One side's figures from its records. times: Unix times warm (training on all hosts), t0
    (the trace's start), end (its end) and settled (the job back on every host left)."""
    progress = Progress(side.points())
    t_warm, t0, t_end, t_settled = times["warm"], times["t0"], times["end"], times["settled"]
    baseline_s, duration_s = t0 - t_warm, t_end - t0
    # Fault-free: steps trained in the baseline window (all kept, unless an event of the trace
    # rolls some back later: that loss is the trace's). Kept: from the steps done at the
    # trace's start to the steps at its end that are never rolled back.
    start = progress.value_at(t0)
    baseline = (start - progress.value_at(t_warm)) * global_batch / baseline_s
    kept = progress.kept_at(t_end) - start
    trained = progress.trained_between(t0, t_end)
    goodput = kept * global_batch / duration_s
    rates = steady_rates(side.segments(), t_warm, t_settled)
    expected = expected_steps(rates, trace, baseline / global_batch)
    others, own = cpu.cores()
    return {
        "goodput": goodput,
        "goodput_fraction": goodput / baseline if baseline else None,
        "fault_free_samples_per_s": baseline,
        "goodput_fraction_same_hosts": kept / expected if expected else None,
        # What the side would keep had no event cost it anything: its own steady rates on the
        # hosts it had, without a second down or a step lost.
        "ceiling_goodput": expected * global_batch / duration_s if expected else None,
        "steady_samples_per_s_by_hosts": {n: r * global_batch for n, r in sorted(rates.items())},
        "samples_kept": kept * global_batch,
        "steps_kept": kept,
        "steps_rolled_back": trained - kept,  # trained in the window, then thrown away (or trained again)
        "restarts": side.restarts(t0, t_end),
        "settle_s": t_settled - t_end,
        # Cores used on average from the side's start to its end: by processes not the bench's
        # (others' builds and tests on this shared machine), and by the side's own.
        "others_cpu_cores": others,
        "own_cpu_cores": own,
        # For the plot: kept samples from the baseline's start to the settled end.
        "curve": [(t - t0, (progress.kept_at(t) - start) * global_batch) for t in frange(t_warm, t_settled, 0.5)],
    }
