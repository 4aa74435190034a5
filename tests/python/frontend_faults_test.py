#!/usr/bin/env python3
"""The Python front end's mixed precision, SIGUSR1 and torchrun paths, with
jobs of real processes on loopback (real c10d Gloo groups, CPU):

  mixed_precision_learns   2x2 jobs in bf16 and in fp16 (dynamic loss scale,
                           initial 1024) of a learnable task, 20 steps: the
                           loss falls to under half its first value and
                           follows the fp32 plain PyTorch loop's (rtol 2e-2
                           bf16, 5e-3 fp16, whose reference skips the
                           overflow step below); every rank reports the same
                           loss, overflow and scale each step; bf16 never
                           overflows and keeps scale 1
  fp16_overflow_skips_the_same_step_everywhere
                           in that fp16 job one rank (stage 0, replica 1)
                           makes infinite gradients in step 8 only: every
                           rank reports overflow=True at step 8 and at no
                           other step, every rank's parameters after step 8
                           equal those after step 7 bit for bit, the scale
                           halves (1024 -> 512) and stays, and the steps
                           before and after change the parameters
  sigusr1_during_a_step    a 2x2 fp32 job whose rank 2 receives SIGUSR1 while
                           it runs the forward of step 2 (the worker tells the
                           test through a pipe that the step is running and
                           waits until the signal was sent): every rank
                           reports checkpoint_requested at step 2 and not
                           before, writes the checkpoint of the finished step
                           (varuna_ckpt_3, COMPLETE, `latest` 3) and exits 75;
                           the job relaunched with --resume_step 3 continues
                           with exactly (bit for bit) the losses and final
                           parameters of an uninterrupted 2x2 job
  sigusr1 without a store  nowhere to write the checkpoint: every rank trains
                           on to the end (exit 0) and rank 0 logs why
  torchrun                 `torchrun --standalone --nproc_per_node 2` runs
                           frontend_worker.py at P=2: losses, parameters and
                           evaluate() equal the plain PyTorch loop's (rtol 1e-5)

    frontend_faults_test.py [name ...]
"""
import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.environ.get("VARUNA_SOURCE_DIR", os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(SOURCE, "scripts"))
import checks  # noqa: E402
import frontend_model  # noqa: E402
import varuna_launch  # noqa: E402  (free_port, clustered_map: the launcher's own)

WORKER = os.path.join(HERE, "frontend_faults_worker.py")
MICRO = 2
DEADLINE_S = 300
failures = checks.failures


def run_job(out, stages, replicas, global_batch, *worker_args, resume_step=None, micro=MICRO):
    """A job of frontend_faults_worker.py under scripts/varuna_launch.py."""
    cmd = [sys.executable, os.path.join(SOURCE, "scripts", "varuna_launch.py"), "--nstages", str(stages),
           "--replicas", str(replicas), "--chunk_size", str(micro), "--batch_size", str(global_batch),
           "--grace", "30", "--preload", checks.PRELOAD]
    if resume_step is not None:
        cmd += ["--resume_step", str(resume_step)]
    cmd += ["--", sys.executable, WORKER, "--out", out, "--global_batch", str(global_batch)]
    cmd += [str(a) for a in worker_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S)
    if proc.returncode != 0:
        raise AssertionError("job %dx%d %s failed (%d):\n%s" % (stages, replicas, worker_args, proc.returncode,
                                                               checks.output_of(proc, 3000)))
    return proc


def records(out, rank):
    with open(os.path.join(out, "rank_%d.jsonl" % rank)) as f:
        return [json.loads(line) for line in f]


def all_records(out, world):
    """Every rank's per-step records; they must agree on what the job-wide
    exchange gives every rank (loss, overflow, loss scale, checkpoint request)."""
    per_rank = [records(out, r) for r in range(world)]
    keys = ("step", "loss", "overflow", "loss_scale", "checkpoint_requested")

    def same(a, b):
        return all(a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])) for k in keys)
    for rank in range(1, world):
        if len(per_rank[rank]) != len(per_rank[0]) or not all(map(same, per_rank[rank], per_rank[0])):
            failures.append("%s: rank %d's steps differ from rank 0's:\n%s\n%s" % (
                out, rank, [[r[k] for k in keys] for r in per_rank[rank]], [[r[k] for k in keys] for r in per_rank[0]]))
    return per_rank


def check_learns(what, steps, reference, rtol):
    """The loss falls clearly, and follows the fp32 plain loop's within rtol."""
    losses = [s["loss"] for s in steps]
    if not all(math.isfinite(x) for x in losses):
        failures.append("%s: a loss is not finite: %s" % (what, losses))
        return
    last = sum(losses[-4:]) / 4
    if not last < 0.5 * losses[0]:
        failures.append("%s: the loss did not fall to under half its first value (%.4f, last four %.4f): %s" % (
            what, losses[0], last, losses))
    if len(losses) != len(reference) or any(abs(a - b) > rtol * abs(b) for a, b in zip(losses, reference)):
        failures.append("%s: losses %s vs the fp32 plain loop's %s (rtol %g)" % (what, losses, reference, rtol))


# --- bf16 and fp16 -----------------------------------------------------------------

# Micro-batches of 8: the first piece's BatchNorm over 2 samples would leave
# little to learn.
LEARN_BATCH, LEARN_MICRO, LEARN_STEPS, OVERFLOW_STEP, OVERFLOW_RANK, INIT_SCALE = 32, 8, 20, 8, 2, 1024.0
_fp16_job = {}


def fp16_job():
    """The fp16 job both fp16 tests look at (run once)."""
    if "out" not in _fp16_job:
        _fp16_job["out"] = out = os.path.join(SCRATCH, "fp16")
        run_job(out, 2, 2, LEARN_BATCH, "--steps", LEARN_STEPS, "--data", "teacher", "--precision", "fp16",
                "--init_loss_scale", INIT_SCALE, "--overflow_at", OVERFLOW_STEP, "--overflow_rank", OVERFLOW_RANK,
                "--record_params", micro=LEARN_MICRO)
    if not os.path.isfile(os.path.join(_fp16_job["out"], "rank_0.pt")):
        raise AssertionError("the fp16 job failed (see above)")
    return _fp16_job["out"]


def test_mixed_precision_learns():
    out = os.path.join(SCRATCH, "bf16")
    run_job(out, 2, 2, LEARN_BATCH, "--steps", LEARN_STEPS, "--data", "teacher", "--precision", "bf16",
            micro=LEARN_MICRO)
    steps = all_records(out, 4)[0]
    reference, _, _ = frontend_model.reference(LEARN_STEPS, LEARN_BATCH, "sgd", LEARN_MICRO,
                                               batch_fn=frontend_model.teacher_batch)
    check_learns("bf16", steps, reference, 2e-2)
    if any(s["overflow"] or s["loss_scale"] != 1.0 for s in steps):
        failures.append("bf16: an overflow or a loss scale other than 1: %s" % steps)
    # The fp16 job skips its overflow step: so does its reference.
    steps = all_records(fp16_job(), 4)[0]
    reference, _, _ = frontend_model.reference(LEARN_STEPS, LEARN_BATCH, "sgd", LEARN_MICRO,
                                               batch_fn=frontend_model.teacher_batch, skip_steps={OVERFLOW_STEP})
    check_learns("fp16", steps, reference, 5e-3)


def test_fp16_overflow_skips_the_same_step_everywhere():
    out = fp16_job()
    steps = all_records(out, 4)[0]
    flags = [s["overflow"] for s in steps]
    if flags != [s == OVERFLOW_STEP for s in range(LEARN_STEPS)]:
        failures.append("fp16: overflow flags %s, expected True at step %d only" % (flags, OVERFLOW_STEP))
    scales = [s["loss_scale"] for s in steps]
    expected = [INIT_SCALE if s <= OVERFLOW_STEP else INIT_SCALE / 2 for s in range(LEARN_STEPS)]
    if scales != expected:
        failures.append("fp16: loss scales %s, expected %s (halved after the overflow)" % (scales, expected))
    if not math.isfinite(steps[OVERFLOW_STEP]["loss"]):
        failures.append("fp16: the overflow step's forward was not meant to overflow: loss %r" % steps[OVERFLOW_STEP])
    for rank in range(4):
        by_step = torch.load(os.path.join(out, "rank_%d.pt" % rank))["by_step"]
        before, at, after = by_step[OVERFLOW_STEP - 1], by_step[OVERFLOW_STEP], by_step[OVERFLOW_STEP + 1]
        changed = [n for n in before if not torch.equal(before[n], at[n])]
        if changed:
            failures.append("fp16: rank %d's skipped step changed %s" % (rank, changed))
        if all(torch.equal(at[n], after[n]) for n in at):
            failures.append("fp16: rank %d's parameters did not change in the step after the overflow" % rank)
        if all(torch.equal(by_step[OVERFLOW_STEP - 2][n], before[n]) for n in at):
            failures.append("fp16: rank %d's parameters did not change in the step before the overflow" % rank)


# --- SIGUSR1 during a step ------------------------------------------------------------

SIGNAL_BATCH, SIGNAL_STEPS, SIGNAL_STEP, SIGNAL_RANK = 8, 6, 2, 2


def start_ranks(out, stages, replicas, global_batch, worker_args, handshake_rank):
    """The job's ranks started as scripts/varuna_launch.py starts them (its
    arguments and environment, SIGUSR1 blocked until the runtime's handler is
    installed), but by this test, which needs each rank's pid and exit code.
    Rank `handshake_rank` gets two pipes: it writes its pid to the first when
    its step is running and waits for a byte on the second."""
    os.makedirs(out, exist_ok=True)
    world = stages * replicas
    port = varuna_launch.free_port()
    stage_map = varuna_launch.clustered_map(stages, replicas)
    from_worker, to_test = os.pipe()
    to_worker_r, to_worker_w = os.pipe()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable, WORKER, "--out", out, "--global_batch", str(global_batch)] + worker_args
        fds = (to_test, to_worker_r) if rank == handshake_rank else ()
        if fds:
            cmd += ["--handshake_fds", "%d,%d" % fds]
        cmd += ["--rank", str(rank), "--local_rank", str(rank), "--stage_to_rank_map", stage_map,
                "--chunk_size", str(MICRO), "--batch-size", str(global_batch // replicas)]
        log = open(os.path.join(out, "rank_%d.log" % rank), "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=fds,
                                      preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})))
        log.close()
    # Only the worker holds these ends now: its exit closes them.
    os.close(to_test)
    os.close(to_worker_r)
    return procs, from_worker, to_worker_w


def logs(out, world):
    text = ""
    for rank in range(world):
        with open(os.path.join(out, "rank_%d.log" % rank)) as f:
            text += "--- rank %d:\n%s\n" % (rank, f.read()[-2000:])
    return text


def wait_all(procs, deadline):
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def kill_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def signal_during_a_step(out, args, world=4):
    """Runs a 2x2 job whose rank SIGNAL_RANK gets SIGUSR1 inside step
    SIGNAL_STEP; returns every rank's exit code."""
    procs, from_worker, to_worker = start_ranks(out, 2, 2, SIGNAL_BATCH, args + ["--signal_at", str(SIGNAL_STEP)],
                                                SIGNAL_RANK)
    deadline = time.monotonic() + DEADLINE_S
    try:
        # Ready: rank 2 is inside step 2 (its first forward), waiting for us.
        message = b""
        while not message.endswith(b"\n"):
            if time.monotonic() > deadline:
                raise AssertionError("rank %d never reached step %d:\n%s" % (SIGNAL_RANK, SIGNAL_STEP,
                                                                              logs(out, world)))
            if select.select([from_worker], [], [], 1.0)[0]:
                chunk = os.read(from_worker, 64)
                if not chunk:
                    raise AssertionError("rank %d exited before step %d:\n%s" % (SIGNAL_RANK, SIGNAL_STEP,
                                                                                  logs(out, world)))
                message += chunk
        pid = int(message)
        if pid != procs[SIGNAL_RANK].pid:
            raise AssertionError("the handshake came from pid %d, not rank %d's %d" % (pid, SIGNAL_RANK,
                                                                                         procs[SIGNAL_RANK].pid))
        os.kill(pid, signal.SIGUSR1)
        os.write(to_worker, b"s")  # the step goes on; the signal has been sent
        return wait_all(procs, deadline)
    finally:
        os.close(from_worker)
        os.close(to_worker)
        kill_all(procs)


def test_sigusr1_during_a_step():
    world = 4
    out = os.path.join(SCRATCH, "sigusr1")
    store = os.path.join(out, "store")
    args = ["--steps", str(SIGNAL_STEPS), "--store", store]
    codes = signal_during_a_step(out, args, world)
    if codes != [75] * world:
        raise AssertionError("exit codes %s, expected 75 (checkpointed on demand) everywhere:\n%s" % (
            codes, logs(out, world)))
    steps = all_records(out, world)[0]
    requested = [s["checkpoint_requested"] for s in steps]
    if requested != [s == SIGNAL_STEP for s in range(SIGNAL_STEP + 1)]:
        failures.append("checkpoint_requested by step %s, expected True at step %d, then the exit" % (
            requested, SIGNAL_STEP))
    ckpt = os.path.join(store, "varuna_ckpt_%d" % (SIGNAL_STEP + 1))
    if not os.path.isfile(os.path.join(ckpt, "COMPLETE")):
        failures.append("no complete checkpoint of the finished step %d: %s" % (SIGNAL_STEP + 1, os.listdir(store)))
    with open(os.path.join(store, "latest")) as f:
        latest = f.read().strip()
    if latest != str(SIGNAL_STEP + 1):
        failures.append("latest is %r, expected %d" % (latest, SIGNAL_STEP + 1))
    others = [n for n in os.listdir(store) if n.startswith("varuna_ckpt_") and n != os.path.basename(ckpt)]
    if others:
        failures.append("checkpoints other than the requested one: %s" % others)

    # Relaunched from that checkpoint, as run_varuna would, against a run never interrupted.
    resumed = os.path.join(SCRATCH, "resumed")
    run_job(resumed, 2, 2, SIGNAL_BATCH, *args, resume_step=SIGNAL_STEP + 1)
    uninterrupted = os.path.join(SCRATCH, "uninterrupted")
    run_job(uninterrupted, 2, 2, SIGNAL_BATCH, "--steps", SIGNAL_STEPS)
    reference = all_records(uninterrupted, world)[0]
    before = [s["loss"] for s in steps]
    after = [s["loss"] for s in all_records(resumed, world)[0]]
    if before != [s["loss"] for s in reference[:SIGNAL_STEP + 1]]:
        failures.append("losses up to the signal %s vs the uninterrupted run's %s" % (before, reference))
    if after != [s["loss"] for s in reference[SIGNAL_STEP + 1:]]:
        failures.append("resumed losses %s vs the uninterrupted run's %s" % (
            after, [s["loss"] for s in reference[SIGNAL_STEP + 1:]]))
    for rank in range(world):
        a = torch.load(os.path.join(resumed, "rank_%d.pt" % rank))
        b = torch.load(os.path.join(uninterrupted, "rank_%d.pt" % rank))
        if a["first"] != SIGNAL_STEP + 1:
            failures.append("rank %d resumed at step %d, expected %d" % (rank, a["first"], SIGNAL_STEP + 1))
        if set(a["params"]) != set(b["params"]) or not all(torch.equal(a["params"][n], b["params"][n])
                                                            for n in b["params"]):
            failures.append("rank %d: the resumed job's final parameters differ from the uninterrupted run's" % rank)


def test_sigusr1_without_a_store():
    # Nowhere to write the checkpoint: exit 75 would promise one, so every
    # rank trains on to the end and rank 0 says why.
    world = 4
    out = os.path.join(SCRATCH, "sigusr1_no_store")
    codes = signal_during_a_step(out, ["--steps", str(SIGNAL_STEPS)], world)
    if codes != [0] * world:
        raise AssertionError("exit codes %s, expected 0 (trained on):\n%s" % (codes, logs(out, world)))
    steps = all_records(out, world)[0]
    if len(steps) != SIGNAL_STEPS or not steps[SIGNAL_STEP]["checkpoint_requested"]:
        failures.append("no store: %d steps recorded (expected %d), request seen at step %d: %s" % (
            len(steps), SIGNAL_STEPS, SIGNAL_STEP, [s["checkpoint_requested"] for s in steps]))
    if "no checkpoint store is configured" not in logs(out, 1):
        failures.append("no store: rank 0 did not say why it trains on:\n%s" % logs(out, 1))


# --- torchrun ---------------------------------------------------------------------------

def test_torchrun():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    runner = [torchrun] if os.path.exists(torchrun) else [sys.executable, "-m", "torch.distributed.run"]
    steps, batch = 4, 8
    out = os.path.join(SCRATCH, "torchrun")
    cmd = runner + ["--standalone", "--nproc_per_node", "2", os.path.join(HERE, "frontend_worker.py"),
                    "--stage_to_rank_map", "0;1;", "--chunk_size", str(MICRO), "--out", out,
                    "--global_batch", str(batch), "--steps", str(steps), "--optimizer", "sgd"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S)
    if proc.returncode != 0:
        raise AssertionError("torchrun job failed (%d):\n%s" % (proc.returncode, checks.output_of(proc, 3000)))
    ref_losses, ref_params, ref_eval = frontend_model.reference(steps, batch, "sgd", MICRO)
    params, losses, held_out = {}, None, None
    for rank in range(2):
        part = torch.load(os.path.join(out, "rank_%d.pt" % rank))
        if part["stage"] != rank:
            failures.append("torchrun: rank %d is stage %d" % (rank, part["stage"]))
        losses, held_out = part["losses"], part["eval"]
        params.update(part["params"])
    if len(losses) != steps or any(abs(a - b) > 1e-5 * max(1.0, abs(b)) for a, b in zip(losses, ref_losses)):
        failures.append("torchrun: losses %s vs the plain loop's %s" % (losses, ref_losses))
    if abs(held_out - ref_eval) > 1e-5 * max(1.0, abs(ref_eval)):
        failures.append("torchrun: evaluate() %r vs the plain loop's %r" % (held_out, ref_eval))
    if set(params) != set(ref_params):
        failures.append("torchrun: parameters %s vs %s" % (sorted(params), sorted(ref_params)))
    else:
        for name, tensor in ref_params.items():
            if not torch.allclose(params[name], tensor, rtol=1e-5, atol=1e-6):
                failures.append("torchrun: %s differs by %.3g" % (name, (params[name] - tensor).abs().max().item()))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="varuna-frontend-faults-") as SCRATCH:
        checks.run(globals())
