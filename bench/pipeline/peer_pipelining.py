#!/usr/bin/env python3
"""The peer for bench/pipeline: the same GPT, weights and data, trained with
torch.distributed.pipelining (Schedule1F1B or ScheduleGPipe) on Gloo, one
process per stage. Prints one JSON line with its mean step time.

The weights are the ones train_gpt dumped (rank<r>_initial.pt, a plain
torch.load-able dict), so both sides start from identical parameters. The peer's
LM head is not tied to the embedding (torch.distributed.pipelining has no
cross-stage weight tying); ours is, which costs us one extra all-reduce.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from peer_gpt import Block, batch, load_text  # noqa: E402


class Embed(nn.Module):
    def __init__(self, vocab, d, seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)

    def forward(self, tokens):
        return self.wte(tokens) + self.wpe(torch.arange(tokens.size(1)))


class Head(nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


class Stage(nn.Module):
    """Pieces registered under the same names as the C++ pieces, so the state
    dict keys ("embed.wte.weight", "block3.qkv.weight", ...) match."""

    def __init__(self, pieces):
        super().__init__()
        self.order = [name for name, _ in pieces]
        for name, module in pieces:
            setattr(self, name, module)

    def forward(self, x):
        for name in self.order:
            x = getattr(self, name)(x)
        return x


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--schedule", choices=["1F1B", "GPipe"], required=True)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch", type=int, required=True, help="global batch")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data", default="/usr/share/common-licenses")
    p.add_argument("--data_seed", type=int, default=7)
    p.add_argument("--weights", required=True, help="folder with rank<r>_initial.pt from train_gpt")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=2, init_method=f"tcp://127.0.0.1:{args.port}")
    text = load_text(args.data)
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    tokens = torch.tensor([index[c] for c in text], dtype=torch.long)

    half = args.layers // 2
    d = args.d_model
    if args.rank == 0:
        pieces = [("embed", Embed(len(vocab), d, args.seq_len))]
        pieces += [(f"block{i}", Block(d, args.heads)) for i in range(half)]
    else:
        pieces = [(f"block{i}", Block(d, args.heads)) for i in range(half, args.layers)]
        pieces += [("head", Head(len(vocab), d))]
    stage_module = Stage(pieces)
    state = torch.load(os.path.join(args.weights, f"rank{args.rank}_initial.pt"))
    stage_module.load_state_dict(state, strict=True)  # identical start to ours

    stage = PipelineStage(stage_module, args.rank, 2, torch.device("cpu"))
    loss_fn = lambda logits, target: F.cross_entropy(logits.reshape(-1, len(vocab)), target.reshape(-1))
    kind = Schedule1F1B if args.schedule == "1F1B" else ScheduleGPipe
    schedule = kind(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=args.lr, weight_decay=0.0)

    times = []
    losses_seen = []
    for step in range(args.warmup + args.steps):
        x, y = batch(tokens, step * args.batch, args.batch, args.seq_len, args.data_seed)
        start = time.perf_counter()
        optimizer.zero_grad()
        if args.rank == 0:
            schedule.step(x)
        else:
            losses = []
            schedule.step(target=y, losses=losses)
            losses_seen.append(float(sum(l.item() for l in losses) / len(losses)))
        optimizer.step()
        times.append(time.perf_counter() - start)
    dist.barrier()
    measured = times[args.warmup:]
    if args.rank == 1:
        print(json.dumps({"schedule": args.schedule, "step_time_s": statistics.median(measured),
                          "first_loss": losses_seen[0], "last_loss": losses_seen[-1]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
