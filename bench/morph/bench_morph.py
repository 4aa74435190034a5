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
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODEL = ["--d_model", "64", "--layers", "4", "--heads", "4", "--seq_len", "32"]
GLOBAL_BATCH, CHUNK = 16, 4
HOSTS = ["127.0.0.1 slots=2", "127.0.0.2 slots=2"]
LEAVING = "127.0.0.2"
# The agents' run folders (connection.json): varuna_agent's default
# <temp dir>/varuna/JOB/HOST, where the temp dir honours TMPDIR as
# std::filesystem::temp_directory_path does (CTest's smoke run sets it).
AGENT_RUN_ROOT = Path(tempfile.gettempdir()) / "varuna"
# Every process the bench starts (and their descendants, which inherit the
# environment) carries this marker, so leftovers can be found and killed.
MARKER = "VARUNA_BENCH_MORPH=%s" % uuid.uuid4().hex


def log(*parts):
    print("[morph %s]" % time.strftime("%H:%M:%S"), *parts, flush=True)


class BenchError(Exception):
    pass


def wait_for(what, predicate, timeout, interval=0.02):
    """Polls predicate() until it returns a true value; raises naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError("timed out after %.0f s waiting for %s" % (timeout, what))
        time.sleep(interval)


def free_port(count=1):
    """A port p such that p .. p+count-1 are free now (bound and released)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + count > 65000:
            continue
        try:
            for extra in range(1, count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + extra))
            return port
        except OSError:
            continue
    raise BenchError("found no %d consecutive free ports" % count)


# --- processes ----------------------------------------------------------------------

def proc_table():
    """pid -> (ppid, environ bytes) of every process we can read."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry.name) as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # after "(comm) state"
            with open("/proc/%s/environ" % entry.name, "rb") as f:
                environ = f.read()
        except (OSError, ValueError):
            continue
        table[int(entry.name)] = (ppid, environ)
    return table


def descendants(root, table=None):
    table = table or proc_table()
    children = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def marked_processes():
    needle = MARKER.encode() + b"\0"
    return [pid for pid, (_, env) in proc_table().items() if needle in env and pid != os.getpid()]


def describe(pids):
    out = []
    for pid in pids:
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                out.append("%d %s" % (pid, f.read().replace(b"\0", b" ").decode(errors="replace")[:120]))
        except OSError:
            pass
    return "; ".join(out)


def kill_all(pids, sig=signal.SIGKILL):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def expect_none_left(what, timeout=15):
    """Waits until no process the bench started is left (the job stopped on its own)."""
    wait_for("no process left after %s (left: %s)" % (what, describe(marked_processes())),
             lambda: not marked_processes(), timeout)


def kill_leftovers(timeout=15):
    """SIGKILLs every process the bench started, directly or not, and waits for them to go.
    Returns the ones still there after the timeout (none, unless something is very wrong)."""
    pids = marked_processes()
    if pids:
        log("killing %d leftover process(es): %s" % (len(pids), describe(pids)))
        kill_all(pids)
    deadline = time.monotonic() + timeout
    while marked_processes() and time.monotonic() < deadline:
        kill_all(marked_processes())
        time.sleep(0.05)
    return marked_processes()


def spawn(argv, log_path, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", **kw.pop("env", {}))
    key, value = MARKER.split("=")
    env[key] = value
    out = open(log_path, "ab")
    try:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, **kw)
    finally:
        out.close()


def tail(path, lines=30):
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no %s)" % path


# --- ours: run_varuna ------------------------------------------------------------------

def read_events(state_dir):
    path = state_dir / "events.jsonl"
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


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
    bin_dir = args.build / "bin"
    argv = [str(bin_dir / "run_varuna"), "--job", job, "--machine_list", str(d / "machines.txt"),
            "--nstages", "2", "--batch_size", str(GLOBAL_BATCH), "--chunk_size", str(CHUNK),
            "--global_store", str(d / "store"), "--state_dir", str(state_dir),
            "--code_dir", str(args.build / "examples" / "gpt"), "--port", "0",
            "--master_port", str(free_port(2)),  # generation g uses master_port + g - 1
            "--", "./train_gpt", "--steps", "1000000", *MODEL, "--threads", "1", "--log_every", "1000000"]
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
        try:
            r = subprocess.run([str(bin_dir / "notify_manager_preempt"), "--connection_file", str(connection)],
                               capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            raise BenchError("notify_manager_preempt did not return within 30 s")
        t_notified = time.time()
        if r.returncode != 0:
            raise BenchError("notify_manager_preempt failed (%d): %s" % (r.returncode, r.stderr.strip()))
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
        # Stop: SIGTERM makes the manager checkpoint and stop the job.
        manager.send_signal(signal.SIGTERM)
        try:
            manager.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise BenchError("run_varuna still running %.0f s after SIGTERM:\n%s" % (args.timeout, tail(log_path)))
        expect_none_left("run_varuna stopped")  # its agents and workers went with it
        return result
    finally:
        kill_leftovers()
        shutil.rmtree(AGENT_RUN_ROOT / job, ignore_errors=True)


# --- peer: torchrun elastic ------------------------------------------------------------

def read_worker_events(folder):
    out = []
    for path in folder.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


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


# How torchrun starts its workers: forked from the agent, which has torch
# imported already, running the script with runpy (--run-path --start-method
# fork; the default here, the faster), or torchrun's own default, a new
# interpreter per worker that imports torch itself (~2.5-3.5 s here).
START_METHODS = {"exec": [], "fork": ["--run-path", "--start-method", "fork"]}


def peer_round(args, rnd, work):
    d = work / ("peer%d" % rnd)
    events = d / "events"
    events.mkdir(parents=True)
    port = free_port()
    torchrun = args.venv / "bin" / "torchrun"
    # Tuned for a fast restart. Timeouts are whole seconds (get_as_int): a dead
    # node leaves the rendezvous keep_alive_interval x keep_alive_max_attempt
    # after its last heartbeat (1 x 2 s; 1 x 1 would expire live nodes whose
    # heartbeat is a little late); the lone survivor then waits
    # last_call_timeout (1 s, the minimum) for others before closing the round.
    conf = "join_timeout=60,last_call_timeout=1,close_timeout=5,heartbeat=5,keep_alive_interval=1," \
           "keep_alive_max_attempt=2,read_timeout=30"
    nodes = {}
    for addr, is_host in (("127.0.0.1", 1), (LEAVING, 0)):
        argv = [str(torchrun), "--nnodes", "1:2", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
                "--rdzv_endpoint", "127.0.0.1:%d" % port, "--rdzv_id", "bench-morph-%d-%d" % (os.getpid(), rnd),
                "--rdzv_conf", "%s,is_host=%d" % (conf, is_host), "--local_addr", addr,
                "--max_restarts", "3", "--monitor_interval", "0.1", *START_METHODS[args.peer_start],
                str(HERE / "peer_dp.py"), "--events", str(events), "--ckpt", str(d / "ckpt.pt"),
                *MODEL, "--batch", str(GLOBAL_BATCH), *(["--fast_exit"] if args.peer_fast_exit else [])]
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the rendezvous store shared
        # (the default), restarted workers can read the previous attempt's Gloo
        # addresses and fail to connect (pytorch/pytorch#135712; seen here:
        # three restarts in a row failed); unshared, rank 0's worker hosts a
        # fresh store each attempt. LOGLEVEL=INFO: the agent logs its
        # decisions with timestamps, which the phases below come from.
        nodes[addr] = spawn(argv, d / ("torchrun-%s.log" % addr),
                            env={"GLOO_SOCKET_IFNAME": "lo", "LOGLEVEL": "INFO",
                                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
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
        survivor.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers
        try:
            survivor.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise BenchError("torchrun still running 30 s after SIGTERM:\n%s" % tail(d / "torchrun-127.0.0.1.log"))
        expect_none_left("torchrun stopped")
        return result
    finally:
        kill_leftovers()


# --- report --------------------------------------------------------------------------

def med(rounds, key):
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


def fmt(x):
    return "%.2f" % x if x is not None else "-"


def interrupted(signum, frame):
    raise KeyboardInterrupt


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
    for path in (args.build / "bin" / "run_varuna", args.build / "bin" / "notify_manager_preempt",
                 args.build / "examples" / "gpt" / "train_gpt", args.venv / "bin" / "torchrun"):
        if not path.exists():
            sys.exit("bench_morph: %s does not exist; build it (ninja -C build run_varuna varuna_agent "
                     "notify_manager_preempt train_gpt) or pass --build / --venv" % path)
    sides = args.sides.split(",")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-morph-"))
    work.mkdir(parents=True, exist_ok=True)
    # Ctrl-C, SIGTERM and SIGHUP unwind through the rounds' clean-ups (SIGINT set
    # explicitly: a shell's background job inherits it ignored).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    ours, peer = [], []
    try:
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
    except KeyboardInterrupt:
        log("interrupted")
        failure = 130
    except BenchError as e:
        log("error:", e)
        failure = 1
    else:
        failure = 0
    finally:
        left = kill_leftovers()
        if args.keep or args.workdir or failure:
            log("work folder kept:", work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    if left:
        log("error: processes still alive after SIGKILL: %s" % describe(left))
        sys.exit(1)
    if failure:
        sys.exit(failure)

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
