#!/usr/bin/env python3
"""Local launcher: starts a Varuna job of P stages x D replicas on this machine.

Every worker gets the arguments run_varuna passes (--rank --local_rank
--stage_to_rank_map --chunk_size --batch-size [--resume_step]) and the
torchrun-style environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). Placement is Varuna's "clustered" one: replica r holds ranks
r*P .. r*P+P-1.

    scripts/varuna_launch.py --nstages 2 --replicas 2 --chunk_size 4 \
        --batch_size 16 -- build/examples/gpt/train_gpt --steps 20

--batch_size is the global batch, as for run_varuna and varuna.Varuna: each
replica gets batch_size / replicas samples a step (the launch contract's
per-replica --batch-size). --replica_batch_size gives that share instead.

If a worker fails, the others get --grace seconds to notice (they exit by
themselves with a clear error) before they are killed; the launcher exits with
the first failing worker's code.

--preload torch,varuna (for a program `python SCRIPT ...` only) imports those
modules once in the launcher and forks every worker from it, as torch's
DataLoader forks its workers, instead of starting a fresh interpreter each:
importing torch costs each worker about 4 s of CPU. The workers run SCRIPT as
__main__ with their own arguments and environment, in this launcher's own
interpreter; they share its hash seed and the state of anything the preloaded
modules set up (seed random generators in the program, as training does).
Nothing may initialise CUDA before the fork (importing torch does not). With
the job token in the environment it starts fresh interpreters instead.
"""
import argparse
import atexit
import ctypes
import importlib
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The launch contract (common/include/varuna/common/launch_contract.h), the
# launcher's side, mirrored: tests/python/launch_contract_test.py checks that
# these write what the C++ writers write and what the worker decodes.
def launcher_argv(rank, local_rank, stage_map, chunk_size, replica_batch_size, resume_step=None):
    """--rank --local_rank --stage_to_rank_map --chunk_size --batch-size [--resume_step]."""
    argv = ["--rank", str(rank), "--local_rank", str(local_rank)]
    if stage_map:
        argv += ["--stage_to_rank_map", stage_map]
    if chunk_size > 0:
        argv += ["--chunk_size", str(chunk_size)]
    if replica_batch_size > 0:
        argv += ["--batch-size", str(replica_batch_size)]
    if resume_step is not None and resume_step >= 0:
        argv += ["--resume_step", str(resume_step)]
    return argv


def rendezvous_environment(rank, local_rank, world_size, master_addr, master_port):
    """RANK LOCAL_RANK WORLD_SIZE MASTER_ADDR MASTER_PORT."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def block_checkpoint_signal():
    """SIGUSR1 blocked until the runtime installs its handler
    (installCheckpointSignalHandler unblocks it): a checkpoint request during
    start-up waits instead of killing the worker."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})


class ForkedWorker:
    """A worker forked from this launcher (--preload) running `script` as
    __main__, with the part of Popen's interface the launcher uses."""

    def __init__(self, script, argv, env):
        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode = None
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                code = self._run(script, argv, env)
            finally:  # whatever happens, the child never returns into the launcher's code
                os._exit(code & 0xFF)

    @staticmethod
    def _run(script, argv, env):
        """In the child: what `python script argv...` would do; its exit code."""
        code, interrupted = 0, False
        try:
            block_checkpoint_signal()
            os.environ.clear()
            os.environ.update(env)
            sys.argv = [script] + argv
            sys.path[0] = os.path.dirname(os.path.realpath(script))
            runpy.run_path(script, run_name="__main__")
        except SystemExit as end:
            code = ForkedWorker._exit_code(end)
        except BaseException as error:  # noqa: BLE001 - as the interpreter reports an uncaught exception
            # Where the interpreter leaves it (atexit handlers look: varuna's
            # leaves without waiting for its peers after a failure).
            error.with_traceback(ForkedWorker._from_script(error.__traceback__, script))
            sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__
            sys.last_exc = error
            sys.excepthook(type(error), error, error.__traceback__)
            code, interrupted = 1, isinstance(error, KeyboardInterrupt)
        try:
            # What an interpreter does on its way out: join its threads, run atexit.
            for thread in threading.enumerate():
                if thread is not threading.main_thread() and not thread.daemon:
                    thread.join()
            atexit._run_exitfuncs()
        except SystemExit as end:
            code = ForkedWorker._exit_code(end)
        except BaseException:  # noqa: BLE001 - a failure on the way out is still an exit
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        ctypes.CDLL(None).fflush(None)  # C and C++ output (printf, std::cout) too: os._exit skips it
        if interrupted:  # as Python does: ends by the signal, so the launcher sees "killed by signal 2"
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return code

    @staticmethod
    def _exit_code(end):
        """The status sys.exit(...) gives (a message: printed, status 1)."""
        if end.code is None or isinstance(end.code, int):
            return end.code or 0
        print(end.code, file=sys.stderr)
        return 1

    @staticmethod
    def _from_script(tb, script):
        """The traceback from the script's own frame on (the launcher's and
        runpy's frames before it are not the program's)."""
        start, path = tb, os.path.realpath(script)
        while start is not None and os.path.realpath(start.tb_frame.f_code.co_filename) != path:
            start = start.tb_next
        return start or tb

    def poll(self):
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                # Reaped by the poll this one interrupted (a signal handler's):
                # that one stores the code.
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum):
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass  # exited and reaped meanwhile

    def kill(self):
        self.send_signal(signal.SIGKILL)


def preload(modules, program):
    """Imports `modules` (comma-separated) here for ForkedWorker. Refuses a
    program that is not `python SCRIPT` run by this launcher's own
    interpreter; False (fresh interpreters instead) where a fork would not do
    what a fresh start does: when the importing started Python threads (a
    fork copies only the calling thread), or when the environment holds the
    job token (the runtime scrubs its copy of the environment, but a forked
    worker's /proc/<pid>/environ is the launcher's, token included)."""
    names = [m for m in modules.split(",") if m]
    if not names:
        return False
    if len(program) < 2 or not os.path.basename(program[0]).startswith("python") or program[1].startswith("-"):
        sys.exit("varuna_launch: --preload needs a program of the form `python SCRIPT [args...]`, not %s"
                 % " ".join(program))
    interpreter = shutil.which(program[0])
    if interpreter is None or os.path.abspath(interpreter) != os.path.abspath(sys.executable):
        sys.exit("varuna_launch: --preload runs the workers in the launcher's own interpreter (%s), not %s: start "
                 "varuna_launch.py with that Python, or leave out --preload" % (sys.executable, program[0]))
    if {"VARUNA_JOB_TOKEN", "VARUNA_JOB_TOKEN_FD"} & set(os.environ):
        print("varuna_launch: --preload: the environment holds the job token; starting fresh interpreters instead",
              file=sys.stderr, flush=True)
        return False
    for name in names:
        importlib.import_module(name)
    if threading.active_count() > 1:
        print("varuna_launch: --preload: importing %s started Python threads; starting fresh interpreters instead"
              % modules, file=sys.stderr, flush=True)
        return False
    return True


def clustered_map(stages: int, replicas: int) -> str:
    return "".join(",".join(str(r * stages + s) for r in range(replicas)) + ";" for s in range(stages))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nstages", type=int, required=True, help="pipeline stages P")
    parser.add_argument("--replicas", type=int, default=1, help="data-parallel replicas D")
    parser.add_argument("--chunk_size", type=int, required=True, help="micro-batch size")
    batch = parser.add_mutually_exclusive_group(required=True)
    batch.add_argument("--batch_size", type=int, help="the global batch (all replicas together)")
    batch.add_argument("--replica_batch_size", type=int, help="each replica's share of the global batch")
    parser.add_argument("--resume_step", type=int, default=None)
    parser.add_argument("--master_port", type=int, default=0, help="0: pick a free port")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds survivors get to exit after a failure")
    parser.add_argument("--preload", default="", metavar="MODULE[,MODULE]",
                        help="import these once here and fork each worker from this process (python SCRIPT only)")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- program [args...]")
    args = parser.parse_args()
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("give the training program after --")
    if args.nstages < 1 or args.replicas < 1:
        parser.error("--nstages and --replicas must be >= 1")
    per_replica = args.replica_batch_size
    if args.batch_size is not None:
        if args.batch_size < 1 or args.batch_size % args.replicas:
            parser.error(f"--batch_size {args.batch_size} (the global batch) must be a positive multiple of "
                         f"--replicas {args.replicas}")
        per_replica = args.batch_size // args.replicas
    if per_replica < 1:
        parser.error("--replica_batch_size must be >= 1")

    world = args.nstages * args.replicas
    port = args.master_port or free_port()
    stage_map = clustered_map(args.nstages, args.replicas)
    forked = preload(args.preload, program)
    print(f"varuna_launch: {args.nstages} stages x {args.replicas} replicas, stage_to_rank_map {stage_map}, "
          f"global batch {per_replica * args.replicas} ({per_replica} per replica), port {port}", flush=True)
    procs = []
    for rank in range(world):
        env = dict(os.environ, **rendezvous_environment(rank, rank, world, "127.0.0.1", port))
        # After the program's own arguments, as run_varuna's agent does: the
        # program may be an interpreter and its script (python train.py).
        argv = launcher_argv(rank, rank, stage_map, args.chunk_size, per_replica, args.resume_step)
        if forked:
            procs.append(ForkedWorker(program[1], program[2:] + argv, env))
        else:
            procs.append(subprocess.Popen(list(program) + argv, env=env, preexec_fn=block_checkpoint_signal))

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGUSR1, forward)

    def first_failure():
        """(rank, code) of the first rank seen to fail so far, or None."""
        return next(((rank, p.poll()) for rank, p in enumerate(procs) if p.poll() not in (None, 0)), None)

    failure = None
    deadline = None
    while any(p.poll() is None for p in procs):
        if failure is None and (failure := first_failure()):
            deadline = time.monotonic() + args.grace
            report(*failure)
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    if failure is None and (failure := first_failure()):
        report(*failure)  # e.g. the only rank, or all at once
    if failure:
        return failure[1] if failure[1] > 0 else 1  # a signal's death (negative) as 1
    return 0


def report(rank, code):
    how = "was killed by signal %d" % -code if code < 0 else "exited with code %d" % code
    print(f"varuna_launch: rank {rank} {how}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
