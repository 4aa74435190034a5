"""What the Python benchmarks that start whole jobs (bench/morph,
bench/goodput) share: their error type, waiting with a deadline, free ports,
the processes they start (spawned with a marker, found and killed by it), the
run_varuna, torchrun and profile_gpt command lines they build (bench/autoconfig
profiles with the last too), and the guard around a bench's rounds that
always cleans up.

Every process started through spawn() carries MARKER in its environment, and
so does everything it starts in turn (children inherit the environment, even
a worker orphaned by its killed agent): kill_leftovers() finds them all by it.
The marker is new in every bench process, so two benches running at once
never touch each other's processes.
"""
import json
import os
import random
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

# The agents' run folders (connection.json): varuna_agent's default
# <temp dir>/varuna/JOB/HOST, where the temp dir honours TMPDIR as
# std::filesystem::temp_directory_path does (CTest's smoke runs set it).
AGENT_RUN_ROOT = Path(tempfile.gettempdir()) / "varuna"
REPO_ROOT = Path(__file__).resolve().parents[2]
MARKER = "VARUNA_BENCH=%s" % uuid.uuid4().hex

# How torchrun starts its workers: forked from the agent, which has torch
# imported already, running the script with runpy (--run-path --start-method
# fork; the faster), or torchrun's own default, a new interpreter per worker
# that imports torch itself (~2.5-3.5 s here).
START_METHODS = {"exec": [], "fork": ["--run-path", "--start-method", "fork"]}

# The environment of every torchrun agent the benches start.
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the rendezvous store shared (the
# default), restarted workers can read the previous attempt's Gloo addresses
# and fail to connect (pytorch/pytorch#135712; seen here: three restarts in a
# row failed); unshared, rank 0's worker hosts a fresh store each attempt.
# LOGLEVEL=INFO: the agent logs its decisions with timestamps (bench/morph's
# phases come from them).
TORCHRUN_ENV = {"GLOO_SOCKET_IFNAME": "lo", "LOGLEVEL": "INFO", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class BenchError(Exception):
    """A run that cannot give figures (a deadline missed, a job that died): the bench cleans up and exits 1."""


def make_log(name):
    """A log function whose lines start with [name HH:MM:SS]."""
    def log(*parts):
        print("[%s %s]" % (name, time.strftime("%H:%M:%S")), *parts, flush=True)
    return log


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


def _ephemeral_low():
    """The first port of the kernel's range for outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(count=1):
    """A port p such that p .. p+count-1 are free now (bound and released).
    One port: the kernel's choice. A range: below the range the kernel takes
    outgoing connections' ports from, where an earlier test's thousands of
    connections (their ports in TIME_WAIT for a minute, which a bind with
    SO_REUSEADDR does not pass) leave no gap of `count` free ports."""
    if count == 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    high = _ephemeral_low() - count
    if high <= 10000:
        raise BenchError("no room for %d free ports between 10000 and the kernel's outgoing range "
                         "(net.ipv4.ip_local_port_range starts at %d): raise its start" % (count, high + count))
    for _ in range(1000):
        port = random.randrange(10000, high)
        if all(_bindable(port + i) for i in range(count)):
            return port
    raise BenchError("found no %d consecutive free ports in 10000-%d" % (count, high + count))


def parse_jsonl(text):
    """The JSON objects of a JSON-lines text; a line being written (not valid yet) is skipped."""
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def median_of(rounds, key):
    """The median of rounds' values of key, those that are None left out; None if none is left."""
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


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
    """root and every process below it."""
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


def kill_leftovers(log, timeout=15):
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
    """Starts argv in a session of its own (a signal to the bench's group does not reach it), output
    appended to log_path, one thread for OpenMP, and MARKER in its environment."""
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


# --- run_varuna ---------------------------------------------------------------------

def require_built(prog, build, venv, how):
    """Exits naming the first of the binaries a job bench runs that is missing, and how to build it."""
    for path in (build / "bin" / "run_varuna", build / "bin" / "notify_manager_preempt",
                 build / "examples" / "gpt" / "train_gpt", venv / "bin" / "torchrun"):
        if not path.exists():
            sys.exit("%s: %s does not exist; build it (%s) or pass --build / --venv" % (prog, path, how))


def pinned_plan(nstages, chunk):
    """run_varuna's plan flags for a fixed number of stages and micro-batch size."""
    return ["--nstages", str(nstages), "--chunk_size", str(chunk)]


def autoconfig_plan(profile):
    """run_varuna's plan flags that let AutoConfig choose every launch's plan from a profile."""
    return ["--profile", str(profile)]


def profile_gpt_argv(build, profile_dir, sizes, repetitions, model):
    """The example GPT's Profiler (profile_gpt) on 2 processes under scripts/varuna_launch.py, so that
    it measures stage compute, transfers and all-reduce; writes profile_dir/profile.json for
    run_varuna --profile. `sizes`: comma-separated micro-batch sizes; `model`: train_gpt's model
    flags (with --threads as the workers will run)."""
    return [sys.executable, str(REPO_ROOT / "scripts" / "varuna_launch.py"), "--nstages", "2", "--chunk_size", "1",
            "--batch_size", "1", "--", str(Path(build) / "examples" / "gpt" / "profile_gpt"),
            "--profile_dir", str(profile_dir), "--micro_batch_sizes", sizes, "--repetitions", str(repetitions),
            *model]


def run_varuna_argv(build, job, folder, machines, plan, batch, master_port, flags=(), train=()):
    """run_varuna training the example GPT (train_gpt, then `train` as its arguments) with the plan
    flags `plan` (pinned_plan or autoconfig_plan), the store and the state folder in `folder`; the
    manager on a free port, generation g's workers on master_port + g - 1."""
    return [str(build / "bin" / "run_varuna"), "--job", job, "--machine_list", str(machines), *plan,
            "--batch_size", str(batch),
            "--global_store", str(folder / "store"), "--state_dir", str(folder / "state"),
            "--code_dir", str(build / "examples" / "gpt"), "--port", "0", "--master_port", str(master_port),
            *flags, "--", "./train_gpt", *train]


def notify_preempt(build, connection, deadline_unix=None, host=None):
    """Announces a host's preemption to the manager as a cloud poller would (notify_manager_preempt
    with the host agent's connection file); raises if the notifier fails or hangs."""
    argv = [str(build / "bin" / "notify_manager_preempt"), "--connection_file", str(connection)]
    if deadline_unix is not None:
        argv += ["--deadline_unix_ms", str(int(deadline_unix * 1000))]
    which = " for %s" % host if host else ""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise BenchError("notify_manager_preempt%s did not return within 30 s" % which)
    if r.returncode != 0:
        raise BenchError("notify_manager_preempt%s failed (%d): %s" % (which, r.returncode, r.stderr.strip()))


def stop_manager(manager, log_path, timeout):
    """SIGTERM to run_varuna (it checkpoints and stops the job), then waits for it and for every
    process it started to be gone."""
    manager.send_signal(signal.SIGTERM)
    try:
        manager.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchError("run_varuna still running %.0f s after SIGTERM:\n%s" % (timeout, tail(log_path)))
    expect_none_left("run_varuna stopped")  # its agents and workers went with it


# --- torchrun -----------------------------------------------------------------------

def fast_rdzv_conf(keep_alive_max_attempt, is_host):
    """c10d rendezvous settings tuned for fast restarts. Timeouts are whole seconds (get_as_int): a
    dead node leaves the rendezvous keep_alive_interval (1 s) x keep_alive_max_attempt after its last
    heartbeat; a lone survivor waits last_call_timeout (1 s, the least) for others before it closes
    the round. read_timeout (the rendezvous store's, which torchrun's agents also wait on for their
    role assignment) is generous: at 30 s a loaded 2-core CI machine once timed out the peer's own
    rendezvous (DistStoreError ... role_info) in bench_goodput_smoke; it only bounds a wait that
    fails, so the restarts the benchmarks measure are unchanged."""
    return ("join_timeout=180,last_call_timeout=1,close_timeout=5,heartbeat=5,keep_alive_interval=1,"
            "keep_alive_max_attempt=%d,read_timeout=180,is_host=%d" % (keep_alive_max_attempt, is_host))


def torchrun_argv(venv, nnodes, nproc, port, rdzv_id, conf, local_addr, max_restarts, start, script):
    """One torchrun node agent (c10d rendezvous at 127.0.0.1:port, checking its workers every 0.1 s)
    running `script`, a list: the worker's path and arguments."""
    return [str(venv / "bin" / "torchrun"), "--nnodes", nnodes, "--nproc_per_node", str(nproc),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:%d" % port, "--rdzv_id", rdzv_id,
            "--rdzv_conf", conf, "--local_addr", local_addr, "--max_restarts", str(max_restarts),
            "--monitor_interval", "0.1", *START_METHODS[start], *script]


def stop_torchrun(nodes, log_of):
    """SIGTERM to every torchrun node agent of nodes (address -> process), which forwards it to its
    workers, then waits for each; log_of(address) is its log, quoted if it hangs."""
    for p in nodes.values():
        p.send_signal(signal.SIGTERM)
    for addr, p in nodes.items():
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise BenchError("torchrun node %s still running 30 s after SIGTERM:\n%s" % (addr, tail(log_of(addr))))


# --- a bench's run --------------------------------------------------------------------

def _interrupted(signum, frame):
    raise KeyboardInterrupt


def unwind_on_signals(keep_ignored=()):
    """Ctrl-C, SIGTERM and SIGHUP raise KeyboardInterrupt, so that the run unwinds through its
    clean-ups (SIGINT set explicitly: a shell's background job inherits it ignored). A signal of
    keep_ignored that is ignored now stays so (SIGHUP under nohup)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if sig not in keep_ignored or signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, _interrupted)


def run_guarded(body, log, work, keep, spare=None):
    """Runs body() (the bench's rounds), then kills every process the bench left and removes the work
    folder (all of it but `spare`, a path inside it) unless `keep` or the run failed. An interruption
    exits 130, a BenchError 1, a process that survives SIGKILL 1; returns only after a clean run."""
    failure = 1  # until body() returns: an unexpected exception keeps the folder too
    try:
        body()
    except KeyboardInterrupt:
        log("interrupted")
        failure = 130
    except BenchError as e:
        log("error:", e)
        failure = 1
    else:
        failure = 0
    finally:
        left = kill_leftovers(log)
        if keep or failure:
            log("work folder kept:", work)
        elif spare is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for entry in work.iterdir():
                if entry != spare:
                    shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink()
    if left:
        log("error: processes still alive after SIGKILL: %s" % describe(left))
        sys.exit(1)
    if failure:
        sys.exit(failure)
