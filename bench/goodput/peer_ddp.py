#!/usr/bin/env python3
"""The peer's worker for bench/goodput: bench/morph's data-parallel GPT (DDP
on Gloo; the model, data and step of bench/common/dp_peer.py, which
bench/morph/peer_dp.py runs too), with periodic checkpoints every
--checkpoint_every steps instead of after every step, as a job that cannot
afford a checkpoint per step runs. Started by torchrun (rank, world size and
the store address come from its environment).

It keeps a fixed global batch, split over whatever world torchrun gives it.
Rank 0 saves model, optimizer and step to --ckpt after every
--checkpoint_every-th step (temp file, then rename); every worker resumes from
that file when it starts, so a restart (a lost node, or a node joining: torchrun
restarts every worker for both) throws away the steps since that checkpoint.

Each worker appends JSON lines to <--events>/rank<r>.<pid>.jsonl, each with a
Unix time "t": "loaded" (checkpoint read, DDP built; resume_step = steps done),
"step" (step = steps done after it, as run_varuna's step reports count),
"checkpoint" (rank 0, step) and "error" when a collective fails (the exception
then propagates and the process exits non-zero, which torchrun watches for).
"""
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

# The DDP peer's model, data, checkpoints and step, shared with bench/morph's peer.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
import dp_peer  # noqa: E402


def main():
    p = dp_peer.peer_parser("checkpoint file (rank 0 writes it every --checkpoint_every steps)",
                            steps=10 ** 9, batch=24)
    p.add_argument("--checkpoint_every", type=int, required=True)
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    record = dp_peer.EventLog(args.events, rank, world).record
    tokens, vocab, model, optimizer = dp_peer.build_model(args)
    dp_peer.init_group()
    first = dp_peer.resume(args.ckpt, model, optimizer)
    ddp = DistributedDataParallel(model)
    record("loaded", resume_step=first)

    share = dp_peer.share_of(args.batch, world)
    try:
        for step in range(first, args.steps):
            dp_peer.train_step(ddp, optimizer, tokens, vocab, args, step, rank, share)
            if rank == 0 and (step + 1) % args.checkpoint_every == 0:
                dp_peer.save(args.ckpt, model, optimizer, step + 1)
                record("checkpoint", step=step + 1)
            record("step", step=step + 1)
    except RuntimeError as e:  # a peer died mid-collective: let torchrun restart us
        record("error", error=str(e)[:200])
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
