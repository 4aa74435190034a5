#!/usr/bin/env python3
"""bench/morph: how long a job is down when it loses a machine, Varuna's morph
against torchrun's elastic restart.

Ours: run_varuna trains the example GPT (d_model 64, 4 blocks, seq 32, one
thread per worker) as 2 stages x 2 replicas on two local "hosts" (127.0.0.1
slots=2, 127.0.0.2 slots=2; global batch 16, micro-batch 4). Once it has done
--warm_steps steps, notify_manager_preempt announces the preemption of
127.0.0.2; the manager has the workers checkpoint on demand and exit, and
relaunches the job as 2 stages x 1 replica on 127.0.0.1. Measured: the
bench's clock when it starts the notifier -> the manager's event
"morph_complete" (its unix_ms: the first step of the new plan has been
reported by every rank), cross-checked against that event's own total_s (the
manager's clock from receiving the notice) and split into its phases.

Peer: torchrun (same torch wheel) runs an equivalent data-parallel job
(peer_dp.py: the same GPT, DDP on Gloo, the same global batch) as two torchrun
"nodes" of two workers each on this machine, c10d rendezvous, --nnodes 1:2,
tuned for a fast restart (see peer_round: short rendezvous timeouts, 0.1 s
monitor interval, workers forked from the agent with torch already imported).
Once it has done --warm_steps steps on 4 workers, the bench SIGKILLs node
127.0.0.2 (its torchrun agent and its workers: a preemption without notice,
which is all torchrun knows how to handle); the survivor's workers fail on
the next all-reduce, its agent re-rendezvouses alone and restarts 2 workers,
which resume from the checkpoint rank 0 writes after every step. Measured:
the kill -> the last of the 2 new workers finishing its first step (the
workers log Unix times of their milestones; the agent's log gives its own).

Rounds interleave the two sides; figures are medians over the rounds. Prints
progress, a table, and as its last line one JSON object with morph_s,
torchrun_restart_s, ratio (= morph_s / torchrun_restart_s) and the phase
medians.

    .venv/bin/python bench/morph/bench_morph.py [--rounds 3] [--workdir DIR] [--keep]
    .venv/bin/python bench/morph/bench_morph.py --smoke   # does it still run? (one round each, not judged)

--smoke: one round of each side, the machine lost after 3 steps instead of
20; the same table and JSON line without "targets" (one round of a cold start
says little). CTest runs it (label bench) so that a bench that no longer runs
fails CI.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# Process, wait and clean-up helpers shared with bench/goodput.
sys.path.insert(0, str(HERE.parent / "common"))
from bench_support import (AGENT_RUN_ROOT, START_METHODS, TORCHRUN_ENV, BenchError, descendants,  # noqa: E402
                           expect_none_left, fast_rdzv_conf, free_port, kill_all, make_log, median_of,
                           notify_preempt, parse_jsonl, pinned_plan, require_built, run_guarded, run_varuna_argv,
                           spawn, stop_manager, stop_torchrun, tail, torchrun_argv, unwind_on_signals,
                           wait_for)
import bench_support  # noqa: E402

MODEL = ["--d_model", "64", "--layers", "4", "--heads", "4", "--seq_len", "32"]
GLOBAL_BATCH, CHUNK = 16, 4
HOSTS = ["127.0.0.1 slots=2", "127.0.0.2 slots=2"]
LEAVING = "127.0.0.2"
log = make_log("morph")


# --- ours: run_varuna ------------------------------------------------------------------

def read_events(state_dir):
    try:
        return parse_jsonl((state_dir / "events.jsonl").read_text())
    except OSError:
        return []


def varuna_step(state_dir):
    try:
        return json.loads((state_dir / "state.json").read_text()).get("progress", {}).get("step", -1)
    except (OSError, ValueError):
        return -1


def varuna_round(args, rnd, work):
    job = "bench-morph-%d-%d" % (os.getpid(), rnd)
    d = work / ("varuna%d" % rnd)
    d.mkdir(parents=True)
    (d / "machines.txt").write_text("".join(h + "\n" for h in HOSTS))
    state_dir, log_path = d / "state", d / "manager.log"
    argv = run_varuna_argv(args.build, job, d, d / "machines.txt", pinned_plan(2, CHUNK), GLOBAL_BATCH,
                           free_port(2),  # generations 1 and 2
                           train=["--steps", "1000000", *MODEL, "--threads", "1", "--log_every", "1000000"])
    manager = spawn(argv, log_path)

    def alive():
        if manager.poll() is not None:
            raise BenchError("run_varuna exited early with %s:\n%s" % (manager.returncode, tail(log_path)))
        return True

    try:
        wait_for("step %d of the 2x2 job (%s)" % (args.warm_steps, log_path),
                 lambda: alive() and varuna_step(state_dir) >= args.warm_steps, args.timeout)
        connection = AGENT_RUN_ROOT / job / LEAVING / "connection.json"
        t_notice = time.time()
        notify_preempt(args.build, connection)
        t_notified = time.time()
        done = wait_for("morph_complete (%s)" % log_path,
                        lambda: alive() and [e for e in read_events(state_dir) if e["event"] == "morph_complete"],
                        args.timeout)[0]
        events = read_events(state_dir)
        plans = [(e["plan"]["stages"], e["plan"]["replicas"]) for e in events if e["event"] == "launch"]
        if plans != [(2, 2), (2, 1)]:
            raise BenchError("expected launches 2x2 then 2x1, got %s" % plans)
        if LEAVING not in done["cause"]:
            raise BenchError("morph_complete for another cause: %s" % done)
        notice = [e for e in events if e["event"] == "preempt_notice"][0]
        resume = [e for e in events if e["event"] == "launch"][1].get("resume_step")
        result = {
            "notice_to_first_step_s": done["unix_ms"] / 1e3 - t_notice,  # external: the bench's clock
            "manager_total_s": done["total_s"],  # internal: the manager's, from its receipt of the notice
            "notice_delivery_s": notice["unix_ms"] / 1e3 - t_notice,
            "notifier_s": t_notified - t_notice,
            "checkpoint_and_teardown_s": done["checkpoint_and_teardown_s"],
            "launch_and_connect_s": done["launch_and_connect_s"],
            "rendezvous_load_first_step_s": done["rendezvous_load_first_step_s"],
            "resume_step": resume,
        }
        stop_manager(manager, log_path, args.timeout)
        return result
    finally:
        bench_support.kill_leftovers(log)
        shutil.rmtree(AGENT_RUN_ROOT / job, ignore_errors=True)


# --- peer: torchrun elastic ------------------------------------------------------------

def read_worker_events(folder):
    return [e for path in folder.glob("rank*.jsonl") for e in parse_jsonl(path.read_text())]


def read_torchrun_log(path):
    """(Unix time, message) of the agent's log lines ("I1122 04:44:37.144000 5825 file:line] message",
    torch's default format, local time). The default format stays on purpose: when a forked worker
    fails, the formatter imports torch._dynamo in the agent (~2 s, while the dead node's heartbeat
    expires anyway), and the workers forked next inherit it instead of importing it in their first
    optimizer; a plain format (TORCH_LOGS_FORMAT) made the restart ~2 s slower."""
    out = []
    year = time.localtime().tm_year
    for line in Path(path).read_text(errors="replace").splitlines():
        if len(line) < 23 or line[0] not in "IWEF" or not line[1:5].isdigit():
            continue
        try:
            stamp = time.strptime("%d %s %s" % (year, line[1:5], line[6:14]), "%Y %m%d %H:%M:%S")
            t = time.mktime(stamp) + float("0" + line[14:21])
        except ValueError:
            continue
        out.append((t, line.split("] ", 1)[-1]))
    return out


def peer_round(args, rnd, work):
    d = work / ("peer%d" % rnd)
    events = d / "events"
    events.mkdir(parents=True)
    port = free_port()
    nodes = {}
    for addr, is_host in (("127.0.0.1", 1), (LEAVING, 0)):
        # A dead node expires 1 x 2 s after its last heartbeat (1 x 1 would expire
        # live nodes whose heartbeat is a little late). The rendezvous store is
        # hosted by the first node's agent (is_host=1): only the second is lost.
        argv = torchrun_argv(args.venv, "1:2", 2, port, "bench-morph-%d-%d" % (os.getpid(), rnd),
                             fast_rdzv_conf(2, is_host), addr, 3, args.peer_start,
                             [str(HERE / "peer_dp.py"), "--events", str(events), "--ckpt", str(d / "ckpt.pt"),
                              *MODEL, "--batch", str(GLOBAL_BATCH),
                              *(["--fast_exit"] if args.peer_fast_exit else [])])
        # TORCHRUN_ENV's LOGLEVEL=INFO: the phases below come from the agent's log.
        nodes[addr] = spawn(argv, d / ("torchrun-%s.log" % addr), env=TORCHRUN_ENV)
    survivor, victim = nodes["127.0.0.1"], nodes[LEAVING]

    def alive():
        for addr, p in nodes.items():
            if p.poll() is not None and not (p is victim and killed):
                raise BenchError("torchrun node %s exited early with %s:\n%s"
                                 % (addr, p.returncode, tail(d / ("torchrun-%s.log" % addr))))
        return True

    killed = False
    try:
        wait_for("step %d on 4 workers (%s)" % (args.warm_steps, d),
                 lambda: alive() and any(e["event"] == "step" and e["world"] == 4 and e["step"] >= args.warm_steps
                                         for e in read_worker_events(events)), args.timeout)
        victims = descendants(victim.pid)
        t_kill = time.time()
        kill_all(victims)
        killed = True

        def restarted():
            after = [e for e in read_worker_events(events) if e["t"] > t_kill]
            first = {}
            for e in after:
                if e["event"] == "step" and e["world"] == 2:
                    first[e["rank"]] = min(first.get(e["rank"], e["t"]), e["t"])
            return (after, first) if len(first) == 2 else None

        after, first = wait_for("the first step on 2 workers after the kill (%s)" % d,
                                lambda: alive() and restarted(), args.timeout)
        new = [e for e in after if e["world"] == 2]
        restarts = {e["restart"] for e in new}
        errors = [e["t"] for e in after if e["event"] == "error" and e["world"] == 4]
        agent = [(t, m) for t, m in read_torchrun_log(d / "torchrun-127.0.0.1.log") if t > t_kill]
        failed = next((t for t, m in agent if "Worker group FAILED" in m), None)
        starting = next((t for t, m in agent if "Starting worker group" in m), None)
        first_step = max(first.values())
        ready = max(e["t"] for e in new if e["event"] == "model_ready")
        result = {
            "kill_to_first_step_s": first_step - t_kill,
            "survivor_error_s": max(errors) - t_kill if errors else None,  # survivors' collective raised
            "detect_s": failed - t_kill if failed else None,  # the agent declared its worker group failed
            "rendezvous_s": starting - failed if failed and starting else None,  # stop + re-rendezvous alone
            "teardown_s": starting - t_kill if starting else None,  # kill -> agent starts new workers
            "process_start_s": min(e["t"] for e in new if e["event"] == "start") - starting if starting else None,
            "import_torch_s": max(e["t"] for e in new if e["event"] == "imported")
                              - min(e["t"] for e in new if e["event"] == "start"),
            "start_s": ready - starting if starting else None,  # spawn, import torch, model, optimizer
            "pg_init_s": max(e["t"] for e in new if e["event"] == "pg_ready") - ready,
            "resume_s": first_step - ready,  # process group, checkpoint load, DDP, first step
            "worker_restarts": len(restarts),
            "resume_step": min(e["resume_step"] for e in new if e["event"] == "loaded"),
        }
        stop_torchrun({"127.0.0.1": survivor}, lambda addr: d / ("torchrun-%s.log" % addr))
        expect_none_left("torchrun stopped")
        return result
    finally:
        bench_support.kill_leftovers(log)


# --- report --------------------------------------------------------------------------

med = median_of


def fmt(x):
    return "%.2f" % x if x is not None else "-"


def run_rounds(args, sides, work, ours, peer):
    """Every side once a round, appending each round's figures to ours and peer."""
    for rnd in range(args.rounds):
        if "varuna" in sides:
            r = varuna_round(args, rnd, work)
            ours.append(r)
            log("round %d varuna: notice -> first 2x1 step %.2f s (manager: %.2f s = checkpoint+teardown %.2f "
                "+ launch+connect %.2f + rendezvous+load+first step %.2f; notice delivered after %.3f s); "
                "resumed at step %s" % (rnd, r["notice_to_first_step_s"], r["manager_total_s"],
                                        r["checkpoint_and_teardown_s"], r["launch_and_connect_s"],
                                        r["rendezvous_load_first_step_s"], r["notice_delivery_s"],
                                        r["resume_step"]))
        if "torchrun" in sides:
            r = peer_round(args, rnd, work)
            peer.append(r)
            log("round %d torchrun: kill -> first step on 2 workers %.2f s (agent sees the failure %s + "
                "re-rendezvous %s + spawn, import torch, model, optimizer %s + process group, load, DDP, "
                "first step %.2f); %d worker start(s); resumed at step %s"
                % (rnd, r["kill_to_first_step_s"], fmt(r["detect_s"]), fmt(r["rendezvous_s"]), fmt(r["start_s"]),
                   r["resume_s"], r["worker_restarts"], r["resume_step"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, default=ROOT / "build")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv", help="has bin/torchrun (the pinned torch)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm_steps", type=int, default=20, help="steps done before the machine goes")
    parser.add_argument("--sides", default="varuna,torchrun")
    parser.add_argument("--peer_start", choices=sorted(START_METHODS), default="fork",
                        help="how torchrun starts workers: exec a new interpreter, or fork its own")
    parser.add_argument("--peer_fast_exit", action="store_true",
                        help="the peer's workers os._exit(1) on a failed collective (not what scripts usually do)")
    parser.add_argument("--timeout", type=float, default=90, help="deadline of every wait, seconds")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temp folder, removed at the end")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, events)")
    parser.add_argument("--smoke", action="store_true",
                        help="one round of each side, 3 warm steps (figures not judged): does the bench still run?")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.warm_steps = 1, 3
    require_built("bench_morph", args.build, args.venv,
                  "ninja -C build run_varuna varuna_agent notify_manager_preempt train_gpt")
    sides = args.sides.split(",")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-morph-"))
    work.mkdir(parents=True, exist_ok=True)
    unwind_on_signals()  # through the rounds' clean-ups
    ours, peer = [], []
    run_guarded(lambda: run_rounds(args, sides, work, ours, peer), log, work, args.keep or args.workdir)

    morph_s, restart_s = med(ours, "notice_to_first_step_s"), med(peer, "kill_to_first_step_s")
    rows = [
        ("**event -> first step on the remaining machine**", morph_s, restart_s),
        ("manager's own total (from its receipt of the notice)", med(ours, "manager_total_s"), None),
        ("stop: checkpoint + teardown / detect + re-rendezvous", med(ours, "checkpoint_and_teardown_s"),
         med(peer, "teardown_s")),
        ("- torchrun: kill -> survivors' all-reduce raises", None, med(peer, "survivor_error_s")),
        ("- torchrun: kill -> agent declares the worker group failed", None, med(peer, "detect_s")),
        ("- torchrun: stop workers + rendezvous alone", None, med(peer, "rendezvous_s")),
        ("start: launch + connect / spawn + import torch + model + optimizer", med(ours, "launch_and_connect_s"),
         med(peer, "start_s")),
        ("- torchrun: import torch", None, med(peer, "import_torch_s")),
        ("resume: rendezvous + load + first step / process group + load + DDP + first step",
         med(ours, "rendezvous_load_first_step_s"), med(peer, "resume_s")),
    ]
    print("\n| median of %d rounds, seconds | varuna morph | torchrun restart |" % args.rounds)
    print("| --- | --- | --- |")
    for name, a, b in rows:
        print("| %s | %s | %s |" % (name, fmt(a), fmt(b)))
    print()
    ratio = morph_s / restart_s if morph_s and restart_s else None
    result = {
        "morph_s": morph_s,
        "torchrun_restart_s": restart_s,
        "ratio": ratio,
        "morph_manager_total_s": med(ours, "manager_total_s"),
        "morph_phases_s": {k: med(ours, k) for k in ("checkpoint_and_teardown_s", "launch_and_connect_s",
                                                      "rendezvous_load_first_step_s", "notice_delivery_s")},
        "torchrun_phases_s": {k: med(peer, k) for k in ("teardown_s", "survivor_error_s", "detect_s",
                                                         "rendezvous_s", "start_s", "process_start_s",
                                                         "import_torch_s", "resume_s", "pg_init_s")},
        "targets": {"morph_s<=5": morph_s is not None and morph_s <= 5,
                    "ratio<=0.5": ratio is not None and ratio <= 0.5},
        "rounds": args.rounds,
        "varuna_rounds_s": [round(r["notice_to_first_step_s"], 3) for r in ours],
        "torchrun_rounds_s": [round(r["kill_to_first_step_s"], 3) for r in peer],
    }
    if args.smoke:
        del result["targets"]
        result["smoke"] = True
    print(json.dumps(result))


if __name__ == "__main__":
    main()
