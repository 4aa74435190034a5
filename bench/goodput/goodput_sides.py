"""bench/goodput's sides: one job each, driven by the trace's replay.

Both classes offer the same calls, which the replay (goodput_replay.py) makes
from the bench's one thread:
  start(); service() (read new records, act on what the job has seen; called
  every ~0.1 s); running_on(hosts, after, min_steps); notice(host, deadline);
  kill(host, noticed) -> processes killed; back(host); stop(); check() (raises
  if the records show the run is void); points(), restarts(t0, t1),
  segments() (what goodput_measure reads); cleanup(); and `dir`, the side's
  folder in the work folder.
"""
import os
import shutil
import signal
import time
from collections import Counter
from pathlib import Path

from bench_support import (AGENT_RUN_ROOT, TORCHRUN_ENV, BenchError, descendants, expect_none_left,
                           fast_rdzv_conf, free_port, kill_all, marked_processes, notify_preempt, proc_table,
                           run_varuna_argv, spawn, stop_manager, stop_torchrun, tail, torchrun_argv, wait_for)
from goodput_measure import JsonlTail

HERE = Path(__file__).resolve().parent
GLOBAL_BATCH = 48  # splits over 1..8 replicas (AutoConfig's pure data parallelism) or 1..4 (2 stages)
SIDES = ("salvage", "no_salvage", "torchrun")
SIDE_LABELS = {"salvage": "(a) run_varuna, salvage", "no_salvage": "(b) run_varuna --no_salvage",
               "torchrun": "(c) torchrun elastic + DDP"}


class VarunaSide:
    """run_varuna on the loopback hosts; salvage on, or off with --no_salvage.

    The machine list is the instance group: a host leaves it only once the manager has seen it go
    (its notice, or its loss), as a cloud's group would drop a reclaimed machine, and comes back
    into it when the trace returns it."""

    def __init__(self, args, name, rnd, work):
        self.args, self.name = args, name
        self.job = "bench-goodput-%s-%d-%d" % (name.replace("_", ""), os.getpid(), rnd)
        self.dir = work / ("%s%d" % (name, rnd))
        self.dir.mkdir(parents=True)
        self.machines, self.log_path = self.dir / "machines.txt", self.dir / "manager.log"
        state_dir = self.dir / "state"
        self.listed = list(args.hosts)
        self.events_tail, self.steps_tail = JsonlTail(state_dir / "events.jsonl"), JsonlTail(state_dir / "steps.jsonl")
        self.events, self.steps = [], []
        self.pending = {}  # host -> (event that must be seen first, after Unix time): then unlist it
        self.manager = None

    def write_machines(self):
        tmp = self.machines.with_suffix(".tmp")
        tmp.write_text("".join("%s slots=%d\n" % (h, self.args.slots) for h in self.listed))
        os.replace(tmp, self.machines)  # the manager never reads half a file

    def start(self):
        self.write_machines()
        flags = ["--no_salvage"] if self.name == "no_salvage" else []
        train = ["--steps", "1000000000", *self.args.model, "--threads", "1", "--log_every", "1000000",
                 "--checkpoint_every", str(self.args.checkpoint_every)]
        # Generation g uses master_port + (g - 1) % 100: a long trace makes many generations.
        argv = run_varuna_argv(self.args.build, self.job, self.dir, self.machines, self.args.plan, GLOBAL_BATCH,
                               free_port(100), flags, train)
        self.manager = spawn(argv, self.log_path)

    def refresh(self):
        if self.manager.poll() is not None:
            raise BenchError("run_varuna exited early with %s:\n%s" % (self.manager.returncode, tail(self.log_path)))
        self.read_files()

    def read_files(self):
        self.events += self.events_tail.new()
        self.steps += self.steps_tail.new()

    def service(self):
        """Unlists a host once the manager has seen it go (its notice, or its loss)."""
        self.refresh()
        for host, (event, since) in list(self.pending.items()):
            if any(e["event"] == event and e.get("host") == host and e["unix_ms"] / 1e3 >= since for e in self.events):
                self.listed.remove(host)
                self.write_machines()
                del self.pending[host]

    def current(self):
        """(generation, plan hosts, launch Unix time, steps done by it) of the newest launch, or None."""
        launches = [e for e in self.events if e["event"] == "launch"]
        if not launches:
            return None
        launch = launches[-1]
        steps = [s["step"] for s in self.steps if s["generation"] == launch["generation"]]
        return (launch["generation"], set(launch["plan"]["hosts"]), launch["unix_ms"] / 1e3,
                max(steps) - max(launch.get("resume_step", 0), 0) if steps else -1)

    def running_on(self, hosts, after, min_steps=1):
        """A generation launched after `after` on exactly these hosts has done min_steps steps."""
        self.service()
        now = self.current()
        return now is not None and now[1] == set(hosts) and now[2] > after and now[3] >= min_steps

    def host_pids(self, host):
        """The host's agent (its command line names the host) and everything it started."""
        table = proc_table()
        agents = []
        for pid in marked_processes():
            try:
                argv = Path("/proc/%d/cmdline" % pid).read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"varuna_agent") and host.encode() in argv and b"--host" in argv:
                agents.append(pid)
        return sorted({p for a in agents for p in descendants(a, table)})

    def notice(self, host, deadline):
        sent = time.time()
        notify_preempt(self.args.build, AGENT_RUN_ROOT / self.job / host / "connection.json", deadline, host)
        self.pending[host] = ("preempt_notice", sent - 1)

    def kill(self, host, noticed):
        pids = self.host_pids(host)
        kill_all(pids)
        if not noticed and not pids:  # no agent there (it never came back): nothing to see go
            self.listed.remove(host)
            self.write_machines()
        elif not noticed:
            # Unlisted only once the manager has seen it lost: a line removed first
            # would be a graceful departure (checkpoint, then relaunch).
            self.pending[host] = ("host_lost", time.time() - 1)
        return len(pids)

    def back(self, host):
        if host in self.pending:
            raise BenchError("%s returns before run_varuna saw it go (pending %s)" % (host, self.pending[host][0]))
        self.listed.append(host)
        self.write_machines()

    def stop(self):
        stop_manager(self.manager, self.log_path, self.args.timeout)
        self.read_files()

    def check(self):
        pass  # one manager, one job: nothing can split

    def points(self):
        pts = [(e["unix_ms"] / 1e3, max(e.get("resume_step", 0), 0), ("g", e["generation"]))
               for e in self.events if e["event"] == "launch"]
        pts += [(s["unix_ms"] / 1e3, s["step"], ("g", s["generation"])) for s in self.steps]
        return sorted(pts, key=lambda p: (p[0], p[1]))

    def restarts(self, t0, t1):
        return sum(1 for e in self.events if e["event"] == "launch" and t0 <= e["unix_ms"] / 1e3 <= t1)

    def plans(self):
        """How many launches ran each plan, e.g. {"2 hosts: 1x4 m=6": 3}: what AutoConfig chose."""
        launched = [e["plan"] for e in self.events if e["event"] == "launch"]
        return dict(sorted(Counter("%d hosts: %dx%d m=%d" % (len(p["hosts"]), p["stages"], p["replicas"],
                                                              p["chunk_size"]) for p in launched).items()))

    def segments(self):
        """(hosts, [(time, steps done)]) of each generation's training, from its second step
        record on (the first includes the start-up)."""
        hosts = {e["generation"]: len(e["plan"]["hosts"]) for e in self.events if e["event"] == "launch"}
        return [(n, [(s["unix_ms"] / 1e3, s["step"]) for s in self.steps if s["generation"] == g][1:])
                for g, n in hosts.items()]

    def cleanup(self):
        shutil.rmtree(AGENT_RUN_ROOT / self.job, ignore_errors=True)


# The peer's c10d rendezvous store, in a process of its own on the head (as
# run_varuna runs on a head node): with the store inside the first node's agent
# (is_host=1), losing that node would end the job.
STORE_SCRIPT = """
import datetime, signal, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
print("store ready", flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(3600)
"""


class TorchrunSide:
    """torchrun --nnodes 1:N, one node agent per loopback host, DDP workers (peer_ddp.py)."""

    def __init__(self, args, name, rnd, work):
        self.args, self.name = args, name
        self.dir = work / ("%s%d" % (name, rnd))
        self.events_dir = self.dir / "events"
        self.events_dir.mkdir(parents=True)
        self.rdzv_id = "bench-goodput-%d-%d" % (os.getpid(), rnd)
        self.nodes, self.store, self.port = {}, None, None
        self.tails, self.records = {}, []
        self.dead = []  # node agents killed by the trace

    def node_log(self, host):
        return self.dir / ("torchrun-%s.log" % host)

    def start(self):
        self.port = free_port()
        store_log = self.dir / "store.log"
        self.store = spawn([str(self.args.venv / "bin" / "python"), "-c", STORE_SCRIPT, str(self.port)], store_log)
        wait_for("the rendezvous store (%s)" % store_log,
                 lambda: self.alive() and "store ready" in store_log.read_text(errors="replace"), self.args.timeout)
        for host in self.args.hosts:
            self.start_node(host)

    def start_node(self, host):
        # Tuned for fast restarts as in bench/morph (see peer_round there), but a node
        # expires after 4 missed keep-alives, not 2, and is_host=0 (the store is the
        # head's). The agent writes its keep-alive only when the last is a whole
        # interval old, so with a 1 s timer the gaps are up to ~2 s: with morph's 2 s
        # expiry a returning node found the live node expired, dropped it and formed
        # a second job of its own on the same checkpoint (seen in the smoke run).
        worker = [str(HERE / "peer_ddp.py"), "--events", str(self.events_dir), "--ckpt", str(self.dir / "ckpt.pt"),
                  "--checkpoint_every", str(self.args.checkpoint_every), *self.args.model, "--batch", str(GLOBAL_BATCH)]
        argv = torchrun_argv(self.args.venv, "1:%d" % len(self.args.hosts), self.args.slots, self.port, self.rdzv_id,
                             fast_rdzv_conf(4, 0), host, 1000000, "fork", worker)
        # TMPDIR: torchrun's log folders and the error file of every failed worker go to the
        # work folder, not /tmp.
        tmp = self.dir / "tmp"
        tmp.mkdir(exist_ok=True)
        self.nodes[host] = spawn(argv, self.node_log(host), env=dict(TORCHRUN_ENV, TMPDIR=str(tmp)))

    def alive(self):
        if self.store.poll() is not None:
            raise BenchError("the rendezvous store exited with %s:\n%s" % (self.store.returncode,
                                                                         tail(self.dir / "store.log")))
        for host, p in self.nodes.items():
            if p.poll() is not None:
                raise BenchError("torchrun node %s exited with %s:\n%s" % (host, p.returncode, tail(self.node_log(host))))
        return True

    def read_files(self):
        for path in self.events_dir.glob("rank0.*.jsonl"):  # global rank 0 counts the job's steps
            self.tails.setdefault(path, JsonlTail(path))
            self.records += self.tails[path].new()

    def service(self):
        self.alive()
        self.read_files()

    def running_on(self, hosts, after, min_steps=1):
        """A generation of workers started after `after` on len(hosts) nodes has done min_steps steps."""
        self.service()
        world = self.args.slots * len(hosts)
        loaded = [r for r in self.records if r["event"] == "loaded" and r["t"] > after and r["world"] == world]
        for r in loaded:
            steps = [s["step"] for s in self.records if s["event"] == "step" and s["pid"] == r["pid"]]
            if steps and max(steps) - r["resume_step"] >= min_steps:
                return True
        return False

    def notice(self, host, deadline):
        pass  # torchrun has no preemption notice: it learns of the loss from the kill

    def kill(self, host, noticed):
        node = self.nodes.pop(host)
        pids = descendants(node.pid)
        kill_all(pids)
        self.dead.append(node)
        return len(pids)

    def back(self, host):
        self.start_node(host)

    def stop(self):
        stop_torchrun(self.nodes, self.node_log)  # the agents forward SIGTERM to their workers
        self.store.send_signal(signal.SIGTERM)
        self.store.wait(timeout=30)
        for p in self.dead:
            p.wait(timeout=5)  # reap the killed agents
        expect_none_left("torchrun stopped")
        self.read_files()

    def check(self):
        """One job at a time: two rank 0 workers stepping at once means the rendezvous split."""
        spans = {}
        for r in self.records:
            if r["event"] == "step":
                lo, hi = spans.get(r["pid"], (r["t"], r["t"]))
                spans[r["pid"]] = (min(lo, r["t"]), max(hi, r["t"]))
        ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
        for (pid_a, (_, end_a)), (pid_b, (start_b, _)) in zip(ordered, ordered[1:]):
            if start_b < end_a - 1:
                raise BenchError("torchrun ran two jobs at once (rank 0 pids %d and %d stepping together): its "
                                 "rendezvous split; see %s" % (pid_a, pid_b, self.dir))

    def points(self):
        pts = [(r["t"], r["resume_step"] if r["event"] == "loaded" else r["step"], ("p", r["pid"]))
               for r in self.records if r["event"] in ("loaded", "step")]
        return sorted(pts, key=lambda p: (p[0], p[1]))

    def restarts(self, t0, t1):
        return sum(1 for r in self.records if r["event"] == "loaded" and t0 <= r["t"] <= t1)

    def plans(self):
        """How many worker generations ran each shape, e.g. {"2 hosts: DDP x4": 3}."""
        return dict(sorted(Counter("%d hosts: DDP x%d" % (r["world"] // self.args.slots, r["world"])
                                   for r in self.records if r["event"] == "loaded").items()))

    def segments(self):
        """(hosts, [(time, steps done)]) of each worker generation's training, from its third
        step on (the first ones include lazy initialisation)."""
        by_pid = {}
        for r in self.records:
            if r["event"] == "step":
                by_pid.setdefault(r["pid"], []).append((r["t"], r["step"], r["world"]))
        return [(steps[0][2] // self.args.slots, [(t, step) for t, step, _ in sorted(steps)[2:]])
                for steps in by_pid.values()]

    def cleanup(self):
        pass
