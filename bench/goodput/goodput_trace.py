"""bench/goodput's preemption trace: machine events drawn from a seeded model
of spot behaviour, with time compressed so that a 10-minute run sees a busy
day's worth of events.

  - arrivals: a Poisson process (exponential gaps, mean --mean_gap_s = 40 s,
    so ~15 events in 10 minutes). Reclamation is driven by other tenants'
    demand, not by the job; memoryless arrivals are the usual model.
  - notice: GCP Spot VMs get ACPI G2 "soft off" 30 s before they are stopped
    (Compute Engine API, Scheduling.skipGuestOsShutdown: "30 seconds for Spot
    VMs"); Azure Spot VMs get a Scheduled Events "Preempt" event at least 30 s
    ahead; AWS a 2-minute interruption notice. Notices are best effort (the
    poller must be running and see it in time) and machines also fail without
    one, so --notice_fraction (0.5) of events come with a 30 s notice and the
    others with none.
  - bulk: Bamboo (Thorpe et al., NSDI '23) reports from its EC2 spot traces
    that preemptions are frequent and often take several instances at once:
    --bulk_fraction (0.2) of events take two hosts.
  - return: the allocator gives a machine back after a while: each lost host
    returns after an exponential time, mean --mean_out_s (60 s), at least
    --min_out_s (10 s); a return due after the end is not replayed.
  - the trace never takes the last host (--min_up 1): with no machine at all
    every side stands still alike. A draw that finds no host to take is
    skipped (counted).

The same seed gives the same draws whatever the duration, so a shorter trace
is the beginning of a longer one (less the returns due after its end).
"""
import random

# Same-time actions replay in this order: a notice before a kill before a return.
ORDER = {"notice": 0, "kill": 1, "return": 2}


class Trace:
    """Machine events of one run, the same for every side and round.

    actions: (t, kind, host, notice) sorted by t, seconds from the trace's start; kind is
    "notice" (the host goes at t + notice_s), "kill" (notice: whether one was given) or "return".
    """

    def __init__(self, seed, hosts, duration_s, notice_s, actions, events, skipped):
        self.seed, self.hosts, self.duration_s, self.notice_s = seed, list(hosts), duration_s, notice_s
        self.actions = sorted(actions, key=lambda a: (a[0], ORDER[a[1]], a[2]))
        self.events, self.skipped = events, skipped

    @classmethod
    def drawn(cls, seed, hosts, duration_s, mean_gap_s, notice_fraction, notice_s, bulk_fraction,
              mean_out_s, min_out_s, min_up):
        """A trace drawn from the model of the module's docstring."""
        rng = random.Random(seed)
        up, back_at = set(hosts), {}
        actions, events, skipped = [], 0, 0
        t = 0.0
        while True:
            # Every draw of an event, taken or not, uses the same random numbers in the
            # same order: the seed alone fixes the trace.
            t += rng.expovariate(1.0 / mean_gap_s)
            bulk = rng.random() < bulk_fraction
            notice = rng.random() < notice_fraction
            pick, outs = rng.random(), [rng.expovariate(1.0 / mean_out_s) for _ in range(2)]
            kill_t = t + (notice_s if notice else 0.0)
            if kill_t >= duration_s:
                break
            _returned(up, back_at, t)
            candidates = sorted(up)
            take = min(2 if bulk else 1, len(candidates) - min_up)
            if take <= 0:
                skipped += 1
                continue
            events += 1
            for host, out in zip(sorted(random.Random(pick).sample(candidates, take)), outs):
                up.discard(host)  # leaving from the notice on: not drawn again
                if notice:
                    actions.append((t, "notice", host, True))
                actions.append((kill_t, "kill", host, notice))
                back_at[host] = kill_t + max(min_out_s, out)
                if back_at[host] < duration_s:
                    actions.append((back_at[host], "return", host, False))
        return cls(seed, hosts, duration_s, notice_s, actions, events, skipped)

    @classmethod
    def from_args(cls, args):
        """The trace of add_arguments' options, on args.hosts."""
        return cls.drawn(args.seed, args.hosts, args.duration_s, args.mean_gap_s, args.notice_fraction,
                         args.notice_s, args.bulk_fraction, args.mean_out_s, args.min_out_s, args.min_up)

    @classmethod
    def smoke(cls, hosts, duration_s):
        """The smoke run's hand-written trace: each kind of event once, the return last (a node lost
        while torchrun's workers are still forming their process group costs the survivors its
        30 s timeout). Needs 3 hosts."""
        notice = 5.0
        actions = [(1.0, "kill", hosts[2], False), (3.0, "notice", hosts[1], True),
                   (3.0 + notice, "kill", hosts[1], True), (12.0, "return", hosts[2], False)]
        return cls("smoke", hosts, duration_s, notice, actions, events=sum(1 for a in actions if a[1] == "kill"),
                   skipped=0)

    def counts(self):
        kills = [a for a in self.actions if a[1] == "kill"]
        return {"events": self.events, "hosts_lost": len(kills),
                "with_notice": sum(1 for a in kills if a[3]), "without_notice": sum(1 for a in kills if not a[3]),
                "returns": sum(1 for a in self.actions if a[1] == "return"), "skipped_draws": self.skipped,
                "duration_s": self.duration_s, "notice_s": self.notice_s}

    def up_at_end(self):
        up = set(self.hosts)
        for _, kind, host, _ in self.actions:
            if kind == "kill":
                up.discard(host)
            elif kind == "return":
                up.add(host)
        return up

    def hosts_up(self):
        """[(t, hosts up from t on)] from 0 to the end, a host counted until it is killed."""
        up, out = len(self.hosts), [(0.0, len(self.hosts))]
        for t, kind, _, _ in self.actions:
            if kind != "notice":
                up += 1 if kind == "return" else -1
                out.append((t, up))
        return out

    def describe(self):
        lines = []
        for t, kind, host, notice in self.actions:
            what = {"notice": "notice: goes in %.0f s" % self.notice_s,
                    "kill": "killed " + ("(after its notice)" if notice else "WITHOUT notice"),
                    "return": "returns"}[kind]
            lines.append("  %6.1f s  %-10s %s" % (t, host, what))
        return "\n".join(lines)


def add_arguments(parser):
    """The trace's options, in a group of their own in --help."""
    g = parser.add_argument_group("the trace (see goodput_trace.py)")
    g.add_argument("--seed", type=int, default=1, help="the trace's seed")
    g.add_argument("--duration_s", type=float, default=600, help="the trace's length")
    g.add_argument("--mean_gap_s", type=float, default=40, help="mean time between events (exponential)")
    g.add_argument("--notice_fraction", type=float, default=0.5, help="share of events with a notice")
    g.add_argument("--notice_s", type=float, default=30, help="a notice's lead (GCP/Azure spot: 30 s)")
    g.add_argument("--bulk_fraction", type=float, default=0.2, help="share of events taking two hosts")
    g.add_argument("--mean_out_s", type=float, default=60, help="mean time a lost host stays away")
    g.add_argument("--min_out_s", type=float, default=10, help="shortest time a lost host stays away")
    g.add_argument("--min_up", type=int, default=1, help="hosts the trace never takes")


def _returned(up, back_at, t):
    """Moves the hosts due back by t from back_at to up: they can be drawn again."""
    for host, tb in list(back_at.items()):
        if tb <= t:
            up.add(host)
            del back_at[host]
