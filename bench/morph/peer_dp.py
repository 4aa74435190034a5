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

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

T_IMPORTED = time.time()

import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from datetime import timedelta  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from peer_gpt import Block, batch as samples, load_text  # noqa: E402


class Gpt(nn.Module):
    """The whole example GPT in one process; the LM head is tied to the token
    embedding, as train_gpt's is by default."""

    def __init__(self, vocab, d, layers, heads, seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.size(1)))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


def load_tokens(path):
    """The text as token ids over its sorted byte alphabet (char_dataset.cpp's vocabulary)."""
    raw = torch.frombuffer(bytearray(load_text(path)), dtype=torch.uint8).long()
    alphabet = torch.unique(raw)  # sorted
    lookup = torch.zeros(256, dtype=torch.long)
    lookup[alphabet] = torch.arange(len(alphabet))
    return lookup[raw], len(alphabet)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--events", required=True, help="folder for the per-worker event files")
    p.add_argument("--ckpt", required=True, help="checkpoint file (rank 0 writes it after every step)")
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--batch", type=int, default=16, help="global batch, split over the workers")
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data", default="/usr/share/common-licenses")
    p.add_argument("--data_seed", type=int, default=7)
    p.add_argument("--fast_exit", action="store_true",
                   help="os._exit(1) when a collective fails, skipping the interpreter's teardown, and die on "
                        "SIGTERM at once (a worker forked by torchrun inherits its handler, which raises instead)")
    args = p.parse_args()
    if args.fast_exit:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = open(os.path.join(args.events, "rank%d.%d.jsonl" % (rank, os.getpid())), "a", buffering=1)

    def record(event, t=None, **fields):
        out.write(json.dumps({"event": event, "t": t or time.time(), "rank": rank, "world": world,
                              "restart": restart, "pid": os.getpid(), **fields}) + "\n")

    record("start", T_START)
    record("imported", T_IMPORTED)
    torch.set_num_threads(1)
    tokens, vocab = load_tokens(args.data)
    torch.manual_seed(1234)  # same initial weights on every worker (DDP broadcasts rank 0's anyway)
    model = Gpt(vocab, args.d_model, args.layers, args.heads, args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    record("model_ready")
    # A lost peer shows up as a closed connection at once; the timeout only bounds a silent hang.
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    record("pg_ready")
    first = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["step"]
    ddp = DistributedDataParallel(model)
    record("loaded", resume_step=first, parameters=sum(p.numel() for p in model.parameters()))

    if args.batch % world:
        raise SystemExit("--batch %d does not split over %d workers" % (args.batch, world))
    share = args.batch // world
    try:
        for step in range(first, args.steps):
            x, y = samples(tokens, step * args.batch + rank * share, share, args.seq_len, args.data_seed)
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(x).reshape(-1, vocab), y.reshape(-1))
            loss.backward()
            optimizer.step()
            if rank == 0:
                tmp = args.ckpt + ".tmp"
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}, tmp)
                os.replace(tmp, args.ckpt)
            record("step", step=step, loss=loss.item())
    except RuntimeError as e:  # a peer died mid-collective: let torchrun restart us
        record("error", error=str(e)[:200])
        if args.fast_exit:
            out.flush()
            os._exit(1)
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
