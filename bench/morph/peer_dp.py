#!/usr/bin/env python3
"""The peer's worker for bench/morph: a data-parallel GPT (DDP on Gloo) of the
size bench_morph runs our train_gpt at, started by torchrun (rank, world size
and the store address come from torchrun's environment).

It keeps a fixed global batch (split over whatever world torchrun gives it),
so losing a node doubles each survivor's share, as a morph does for Varuna.
Rank 0 saves model and optimizer to --ckpt after every step (write to a temp
file, then rename), and every worker resumes from that file when it starts, so
a restart loses at most the step in flight. No preemption notice reaches the
peer: torchrun has none, it only sees its workers or a node die.

Each worker appends JSON lines to <--events>/rank<r>.<pid>.jsonl, each with a
Unix time "t": "start" (first line of the script, before `import torch`;
with --run-path --start-method fork, right after the fork), "imported",
"model_ready" (model and optimizer built: the first optimizer imports
torch._dynamo, ~1.5 s here, unless forked from an agent that has it),
"pg_ready" (process group up), "loaded"
(checkpoint read, DDP built), one "step" per completed step, and "error" if a
collective fails (the exception then propagates and the process exits
non-zero, which is what torchrun watches for).
"""
import time

T_START = time.time()  # before `import torch`: process start as torchrun sees it

import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

# Imported here, alone, to time it (T_IMPORTED); the rest of torch comes after.
import torch  # noqa: E402,F401

T_IMPORTED = time.time()

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

# The DDP peer's model, data, checkpoints and step, shared with bench/goodput's peer.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "common"))
import dp_peer  # noqa: E402


def main():
    p = dp_peer.peer_parser("checkpoint file (rank 0 writes it after every step)", steps=100000, batch=16)
    p.add_argument("--fast_exit", action="store_true",
                   help="os._exit(1) when a collective fails, skipping the interpreter's teardown, and die on "
                        "SIGTERM at once (a worker forked by torchrun inherits its handler, which raises instead)")
    args = p.parse_args()
    if args.fast_exit:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = dp_peer.EventLog(args.events, rank, world, restart=restart)
    record = events.record

    record("start", T_START)
    record("imported", T_IMPORTED)
    tokens, vocab, model, optimizer = dp_peer.build_model(args)
    record("model_ready")
    dp_peer.init_group()
    record("pg_ready")
    first = dp_peer.resume(args.ckpt, model, optimizer)
    ddp = DistributedDataParallel(model)
    record("loaded", resume_step=first, parameters=sum(p.numel() for p in model.parameters()))

    share = dp_peer.share_of(args.batch, world)
    try:
        for step in range(first, args.steps):
            loss = dp_peer.train_step(ddp, optimizer, tokens, vocab, args, step, rank, share)
            if rank == 0:
                dp_peer.save(args.ckpt, model, optimizer, step + 1)
            record("step", step=step, loss=loss.item())
    except RuntimeError as e:  # a peer died mid-collective: let torchrun restart us
        record("error", error=str(e)[:200])
        if args.fast_exit:
            events.flush()
            os._exit(1)
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
