#!/usr/bin/env python3
"""The Python front end (the varuna package) on the C++ engine, against a plain
single-process PyTorch loop (frontend_model.py), with jobs of real processes
started by scripts/varuna_launch.py on loopback:

  equivalence   every schedule as 2x1, and 1x1, 1x2, 2x2 (the default and a
                chunked schedule) and 3x1: the losses and every parameter after 4 steps
                equal the plain loop's (fp32, rtol 1e-5), and so does
                evaluate() (eval mode) with one replica
  optimizers    SGD with momentum, AdamW and RMSprop (which the C++ side
                lacks): a checkpoint taken as 2x2 after 2 steps and loaded as
                1x2 and as 3x1 gives the same parameters after 4 steps as an
                uninterrupted run
  buffers       the BatchNorm running statistics are the same on every replica
  frozen        parameters built with requires_grad=False keep their
                values (AdamW with weight decay would move them) and are
                state, not trained parameters
  piece error   a Python exception in a piece fails its rank with the
                traceback, and the others with a lost-peer error

    frontend_test.py [name ...]
"""
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import frontend_model  # noqa: E402
import checks  # noqa: E402

GLOBAL_BATCH, MICRO, STEPS = 8, 2, 4
SCHEDULES = ["varuna", "1f1b", "gpipe", "zb-h1", "interleaved", "zbv"]
failures = checks.failures


def run_job(out, stages, replicas, *worker_args, expect_ok=True):
    proc = checks.launch(os.path.join(HERE, "frontend_worker.py"), stages, replicas, MICRO, GLOBAL_BATCH,
                         ["--out", out, "--global_batch", GLOBAL_BATCH] + list(worker_args))
    if expect_ok and proc.returncode != 0:
        raise AssertionError("job %sx%s %s failed (%d):\n%s" % (stages, replicas, worker_args, proc.returncode,
                                                               proc.stdout[-3000:] + proc.stderr[-3000:]))
    return proc


def gathered(out, world):
    params, losses = {}, None
    for rank in range(world):
        part = torch.load(os.path.join(out, "rank_%d.pt" % rank))
        losses = part["losses"]
        for name, tensor in part["params"].items():
            if name in params and not torch.equal(params[name], tensor):
                raise AssertionError("replicas disagree on %s" % name)
            params[name] = tensor
    return losses, params


def compare(what, losses, params, ref_losses, ref_params):
    if len(losses) != len(ref_losses) or any(abs(a - b) > 1e-5 * max(1.0, abs(b)) for a, b in zip(losses, ref_losses)):
        failures.append("%s: losses %s vs the plain loop's %s" % (what, losses, ref_losses))
    if set(params) != set(ref_params):
        failures.append("%s: parameters %s vs %s" % (what, sorted(params), sorted(ref_params)))
        return
    for name, tensor in ref_params.items():
        if not torch.allclose(params[name], tensor, rtol=1e-5, atol=1e-6):
            failures.append("%s: %s differs by %.3g" % (what, name, (params[name] - tensor).abs().max().item()))


def test_equivalence():
    ref_losses, ref_params, ref_eval = frontend_model.reference(STEPS, GLOBAL_BATCH, "sgd", MICRO)
    # Every schedule with Python pieces on 2 stages, and every layout once. The
    # engine's own tests (pipeline_ and chunked_equivalence_test) run every
    # schedule under every layout; each case here is a job of up to four Python
    # processes (about 6 s of CPU each to import torch and to take a first
    # torch.optim step, which imports torch._dynamo), so this
    # covers what is the front end's own: its pieces, batches and optimizer
    # under each schedule, data parallelism, an odd number of stages.
    # The model has 4 pieces: the chunked schedules (two chunks per stage) run on up to 2 stages.
    cases = [(2, 1, schedule) for schedule in SCHEDULES]
    cases += [(1, 1, "varuna"), (1, 2, "interleaved"), (2, 2, "varuna"), (2, 2, "zbv"), (3, 1, "zb-h1")]
    for stages, replicas, schedule in cases:
        with tempfile.TemporaryDirectory() as tmp:
            run_job(tmp, stages, replicas, "--steps", STEPS, "--optimizer", "sgd", "--schedule", schedule)
            losses, params = gathered(tmp, stages * replicas)
            compare("%dx%d %s" % (stages, replicas, schedule), losses, params, ref_losses, ref_params)
            # evaluate() runs the Python modules in eval mode (BatchNorm's running statistics);
            # with one replica those are the plain loop's.
            rank0 = torch.load(os.path.join(tmp, "rank_0.pt"))
            held_out = rank0["eval"]
            # What rank 0 holds: under zbv on 2 stages the first and the last of the 4 pieces (and the loss).
            if (stages, schedule) == (2, "zbv") and (rank0["owned_pieces"], rank0["num_chunks"],
                                                      rank0["is_last_stage"]) != ([(0, 1), (3, 4)], 2, True):
                failures.append("2x%d zbv: rank 0 holds %r in %r chunks, is_last_stage %r" % (
                    replicas, rank0["owned_pieces"], rank0["num_chunks"], rank0["is_last_stage"]))
            if replicas == 1 and abs(held_out - ref_eval) > 1e-5 * max(1.0, abs(ref_eval)):
                failures.append("%dx%d %s: evaluate() %r vs the plain loop's %r" % (
                    stages, replicas, schedule, held_out, ref_eval))


def test_optimizers_resume_under_other_layouts():
    for optimizer in ["sgd", "adamw", "rmsprop"]:
        ref_losses, ref_params, _ = frontend_model.reference(STEPS, GLOBAL_BATCH, optimizer, MICRO)
        with tempfile.TemporaryDirectory() as tmp:
            store = os.path.join(tmp, "store")
            run_job(os.path.join(tmp, "first"), 2, 2, "--steps", 2, "--optimizer", optimizer, "--save_at", 2,
                    "--store", store)
            for stages, replicas in [(1, 2), (3, 1)]:
                out = os.path.join(tmp, "%dx%d" % (stages, replicas))
                run_job(out, stages, replicas, "--steps", STEPS, "--optimizer", optimizer, "--load", 2,
                        "--store", store)
                losses, params = gathered(out, stages * replicas)
                compare("%s 2x2 -> %dx%d" % (optimizer, stages, replicas), losses, params, ref_losses[2:],
                        ref_params)


def test_buffers_agree_across_replicas():
    with tempfile.TemporaryDirectory() as tmp:
        run_job(tmp, 2, 2, "--steps", 2)
        parts = [torch.load(os.path.join(tmp, "rank_%d.pt" % r)) for r in range(4)]
        by_stage = {}
        for part in parts:
            by_stage.setdefault(part["stage"], []).append(part["buffers"])
        for stage, buffers in by_stage.items():
            for name in buffers[0]:
                if not all(torch.equal(b[name], buffers[0][name]) for b in buffers):
                    failures.append("stage %d: buffer %s differs between replicas" % (stage, name))
        if not any("running_mean" in n for b in by_stage.get(0, [{}]) for n in b):
            failures.append("stage 0 has no BatchNorm running_mean buffer: %s" % list(by_stage.get(0, [{}])[0]))


def test_frozen_parameters_stay_and_are_not_trained():
    import varuna
    if varuna.ConfigError.exit_code != 2 or varuna.Error.exit_code != 1:
        failures.append("exit codes of the exception classes: %r %r" % (varuna.ConfigError.exit_code,
                                                                        varuna.Error.exit_code))
    torch.manual_seed(frontend_model.SEED + 1)
    initial = {"h1." + n: p.detach().clone() for n, p in frontend_model.HiddenPiece().named_parameters()}
    with tempfile.TemporaryDirectory() as tmp:
        run_job(tmp, 2, 2, "--steps", 2, "--optimizer", "adamw", "--freeze_h1")
        parts = [torch.load(os.path.join(tmp, "rank_%d.pt" % r)) for r in range(4)]
        trained = set().union(*(p["params"] for p in parts))
        state = {n: t for p in parts for n, t in p["buffers"].items()}
        if trained & set(initial):
            failures.append("frozen parameters were given to the optimizer: %s" % sorted(trained & set(initial)))
        for name, tensor in initial.items():
            if name not in state or not torch.equal(state[name], tensor):
                failures.append("frozen %s changed or is missing from the state" % name)


def test_python_exception_in_a_piece():
    with tempfile.TemporaryDirectory() as tmp:
        proc = run_job(tmp, 2, 1, "--steps", STEPS, "--fail_in_piece", 0, expect_ok=False)
        output = proc.stdout + proc.stderr
        if proc.returncode == 0:
            failures.append("a job whose piece raised exited 0")
        if "a bug in the user's piece" not in output or "Traceback" not in output:
            failures.append("the failing rank's traceback is not in the output:\n" + output[-2000:])


if __name__ == "__main__":
    checks.run(globals())
