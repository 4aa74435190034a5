"""One rank of a front-end fault test job (frontend_faults_test.py): trains
frontend_model.py's pieces with varuna.Varuna, appends one JSON line per step
to --out/rank_<r>.jsonl (before it may exit on a checkpoint request) and, at
the end, writes its parameters (after every step with --record_params) to
--out/rank_<r>.pt.

    frontend_faults_worker.py --out DIR --global_batch G --steps N
        [--precision fp32|bf16|fp16] [--init_loss_scale S] [--data plain|teacher]
        [--overflow_at STEP --overflow_rank R] [--record_params]
        [--store DIR] [--handshake_fds W,R --signal_at STEP]
        [--device cpu|cuda] [--comm_backend auto|gloo|nccl]

--overflow_at: in that step, on rank R, every gradient leaving this rank's
pieces is infinite (what a loss scale too large for fp16 produces).
--handshake_fds: in the first forward of step --signal_at, this rank writes
its pid to fd W and waits for one byte on fd R: the test sends SIGUSR1 in
between, so the signal arrives while the step is running.
--store: the checkpoint store; with the launcher's --resume_step the job
first loads the newest checkpoint at or below it.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import frontend_model  # noqa: E402
import varuna  # noqa: E402

varuna.install_checkpoint_signal_handler()
launch = varuna.get_launch_args()
parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--global_batch", type=int, required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--precision", default="fp32")
parser.add_argument("--init_loss_scale", type=float, default=1048576)
parser.add_argument("--data", choices=["plain", "teacher"], default="plain",
                    help="plain: frontend_model's random targets; teacher: targets a fixed function of the inputs")
parser.add_argument("--overflow_at", type=int, default=-1)
parser.add_argument("--overflow_rank", type=int, default=-1)
parser.add_argument("--record_params", action="store_true")
parser.add_argument("--store", default="")
parser.add_argument("--handshake_fds", default="")
parser.add_argument("--signal_at", type=int, default=-1)
parser.add_argument("--device", default="cpu")
parser.add_argument("--comm_backend", default="auto")
args = parser.parse_args(launch.user_args)

current_step = -1  # the step being run; the pieces read it (-1: the runtime's sample forward)
handshake_done = False


batch_of = frontend_model.teacher_batch if args.data == "teacher" else frontend_model.global_batch


class InfiniteGradient(torch.autograd.Function):
    """The identity whose backward returns an infinite gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("inf"))


def handshake():
    """Tells the test this step is running and waits until it has sent SIGUSR1."""
    write_fd, read_fd = (int(fd) for fd in args.handshake_fds.split(","))
    os.write(write_fd, b"%d\n" % os.getpid())
    os.close(write_fd)
    if os.read(read_fd, 1) != b"s":
        raise RuntimeError("the test went away before sending SIGUSR1")
    os.close(read_fd)


def instrumented(factory):
    """factory's piece, with the faults this rank was asked to inject."""
    class Piece(factory):
        def forward(self, activation, inputs):
            global handshake_done
            if args.handshake_fds and current_step == args.signal_at and not handshake_done:
                handshake_done = True  # once: a recomputed forward runs again
                handshake()
            out = super().forward(activation, inputs)
            if current_step == args.overflow_at and launch.rank == args.overflow_rank:
                out = InfiniteGradient.apply(out)
            return out
    Piece.__name__ = factory.__name__
    return Piece


try:
    pieces = [(name, instrumented(factory)) for name, factory in frontend_model.pieces()]
    model = varuna.Varuna(pieces, get_batch_fn=frontend_model.get_batch, batch_size=args.global_batch,
                          launch_args=launch, seed=frontend_model.SEED, precision=args.precision,
                          peer_timeout_s=20, global_store=args.store or None, device=args.device,
                          comm_backend=args.comm_backend)
    optimizer = frontend_model.make_optimizer("sgd", model.parameters())
    model.set_optimizer(optimizer, init_loss_scale=args.init_loss_scale)
    first = 0
    if launch.resume_step >= 0:
        first = model.load_latest_checkpoint(args.store, at_most=launch.resume_step)
        if first is None:
            raise RuntimeError("no checkpoint at or below step %d in %s" % (launch.resume_step, args.store))
    os.makedirs(args.out, exist_ok=True)
    record_path = os.path.join(args.out, "rank_%d.jsonl" % launch.rank)
    share = args.global_batch // model.num_replicas
    by_step = {}
    if args.record_params:
        by_step[first - 1] = {name: p.detach().clone() for name, p in model.named_parameters()}
    for step in range(first, args.steps):
        batch = batch_of(step, args.global_batch)
        inputs = {k: v[model.replica * share:(model.replica + 1) * share] for k, v in batch.items()}
        current_step = step
        result = model.step(inputs)
        if args.record_params:
            by_step[step] = {name: p.detach().clone() for name, p in model.named_parameters()}
        with open(record_path, "a") as f:
            f.write(json.dumps({"step": step, "loss": result.loss, "overflow": result.overflow,
                                "grad_norm": result.grad_norm, "loss_scale": result.loss_scale,
                                "checkpoint_requested": result.checkpoint_requested,
                                "steps_done": model.steps_done}) + "\n")
        model.exit_if_checkpoint_requested(result)
    torch.save({"params": {name: p.detach().clone() for name, p in model.named_parameters()},
                "by_step": by_step, "first": first, "stage": model.stage, "replica": model.replica},
               os.path.join(args.out, "rank_%d.pt" % launch.rank))
except Exception as error:  # noqa: BLE001 - every failure ends the worker with its code
    varuna.exit_after_failure(error)
