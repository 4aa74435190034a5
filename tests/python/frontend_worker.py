"""One rank of a front-end test job (frontend_test.py), started by
scripts/varuna_launch.py: trains frontend_model.py's pieces with varuna.Varuna
and writes its losses and its stage's parameters to --out/rank_<r>.pt.

    frontend_worker.py --out DIR --global_batch G --steps N --optimizer NAME
        [--schedule S] [--save_at STEP --store DIR] [--load STEP --store DIR]
        [--fail_in_piece RANK]
"""
import argparse
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
parser.add_argument("--optimizer", default="sgd")
parser.add_argument("--schedule", default="varuna")
parser.add_argument("--save_at", type=int, default=-1)
parser.add_argument("--load", type=int, default=-1)
parser.add_argument("--store", default="")
parser.add_argument("--fail_in_piece", type=int, default=-1, help="this rank's first piece raises in step 1")
parser.add_argument("--freeze_h1", action="store_true", help="h1's parameters are built with requires_grad=False")
args = parser.parse_args(launch.user_args)

pieces = frontend_model.pieces()
if args.freeze_h1:
    def frozen():
        piece = frontend_model.HiddenPiece()
        for p in piece.parameters():
            p.requires_grad_(False)
        return piece
    pieces[1] = ("h1", frozen)
if args.fail_in_piece == launch.rank:
    class Failing(frontend_model.HiddenPiece):
        calls = 0

        def forward(self, activation, inputs):
            Failing.calls += 1
            if Failing.calls > 2:
                raise RuntimeError("a bug in the user's piece")
            return super().forward(activation, inputs)
    pieces[1] = ("h1", Failing)

try:
    model = varuna.Varuna(pieces, get_batch_fn=frontend_model.get_batch, batch_size=args.global_batch,
                          launch_args=launch, seed=frontend_model.SEED, schedule=args.schedule,
                          peer_timeout_s=20)
    optimizer = frontend_model.make_optimizer(args.optimizer, model.parameters())
    model.set_optimizer(optimizer)
    first = 0
    if args.load >= 0:
        first = model.load_checkpoint(args.store, args.load)
    share = args.global_batch // model.num_replicas
    losses = []
    for step in range(first, args.steps):
        batch = frontend_model.global_batch(step, args.global_batch)
        inputs = {k: v[model.replica * share:(model.replica + 1) * share] for k, v in batch.items()}
        result = model.step(inputs)
        losses.append(result.loss)
        if step + 1 == args.save_at:
            model.checkpoint(args.store, on_demand=True)
    held_out = frontend_model.global_batch(args.steps, args.global_batch)
    evaluation = model.evaluate({k: v[model.replica * share:(model.replica + 1) * share] for k, v in held_out.items()})
    named = {name: p.detach().clone() for name, p in model.named_parameters()}
    os.makedirs(args.out, exist_ok=True)
    torch.save({"losses": losses, "params": named, "eval": evaluation, "stage": model.stage, "replica": model.replica,
                "buffers": {n: b.clone() for n, b in model.named_buffers()},
                "owned_pieces": [tuple(r) for r in model.owned_pieces], "num_chunks": model.num_chunks,
                "is_last_stage": model.is_last_stage},
               os.path.join(args.out, "rank_%d.pt" % launch.rank))
except Exception as error:  # noqa: BLE001 - every failure ends the worker with its code
    varuna.exit_after_failure(error)
