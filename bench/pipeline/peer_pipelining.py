#!/usr/bin/env python3
"""The peer for bench/pipeline: the same GPT, weights and data, trained with
torch.distributed.pipelining on Gloo, one process per rank, with any of its
schedules: 1F1B and GPipe (one stage per rank), Interleaved1F1B and
InterleavedZeroBubble (two stages per rank, looped: rank r holds stages r and
r + P), ZBVZeroBubble and DualPipeV (two stages per rank in a V: rank r holds
r and 2P - 1 - r). The blocks are split evenly over the stages; the
embedding goes with the first, the head with the last. Prints one JSON line
with its median step time.

The weights are the ones train_gpt dumped (rank<r>_initial.pt, a plain
torch.load-able dict), so both sides start from identical parameters. The peer's
LM head is not tied to the embedding (torch.distributed.pipelining has no
cross-stage weight tying); ours is, which costs us one extra all-reduce.
"""
import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                         ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                         ScheduleZBVZeroBubble)

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


# Schedule name -> (class, how a rank's stages are placed).
SCHEDULES = {
    "1F1B": (Schedule1F1B, "single"),
    "GPipe": (ScheduleGPipe, "single"),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, "looped"),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, "looped"),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, "v"),
    "DualPipeV": (ScheduleDualPipeV, "v"),
}


def stages_of(rank, ranks, placement):
    if placement == "single":
        return [rank]
    if placement == "looped":
        return [rank, rank + ranks]
    return [rank, 2 * ranks - 1 - rank]


def stage_pieces(stage, stages, layers, vocab, d, heads, seq_len):
    """Stage `stage` of `stages`: its blocks, the embedding first, the head last."""
    if layers % stages:
        raise SystemExit(f"peer_pipelining: {layers} layers do not split over {stages} stages")
    per = layers // stages
    pieces = [("embed", Embed(vocab, d, seq_len))] if stage == 0 else []
    pieces += [(f"block{i}", Block(d, heads)) for i in range(stage * per, (stage + 1) * per)]
    if stage == stages - 1:
        pieces += [("head", Head(vocab, d))]
    return pieces


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--schedule", choices=sorted(SCHEDULES), required=True)
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
    dist.init_process_group("gloo", rank=args.rank, world_size=args.ranks,
                            init_method=f"tcp://127.0.0.1:{args.port}")
    text = load_text(args.data)
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    tokens = torch.tensor([index[c] for c in text], dtype=torch.long)

    kind, placement = SCHEDULES[args.schedule]
    total = args.ranks * (1 if placement == "single" else 2)
    # Identical start to ours: train_gpt's initial parameters of every rank,
    # by name (the pieces carry the C++ pieces' names).
    initial = {}
    for r in range(args.ranks):
        initial.update(torch.load(os.path.join(args.weights, f"rank{r}_initial.pt")))
    stages, modules = [], []
    for index_ in stages_of(args.rank, args.ranks, placement):
        module = Stage(stage_pieces(index_, total, args.layers, len(vocab), args.d_model, args.heads, args.seq_len))
        module.load_state_dict({k: initial[k] for k in module.state_dict()}, strict=True)
        modules.append(module)
        stages.append(PipelineStage(module, index_, total, torch.device("cpu")))
    holds_first = any(stage.stage_index == 0 for stage in stages)
    holds_last = any(stage.stage_index == total - 1 for stage in stages)
    loss_fn = lambda logits, target: F.cross_entropy(logits.reshape(-1, len(vocab)), target.reshape(-1))
    schedule = kind(stages[0] if placement == "single" else stages, n_microbatches=args.microbatches,
                    loss_fn=loss_fn)
    optimizer = torch.optim.AdamW([q for m in modules for q in m.parameters()], lr=args.lr, weight_decay=0.0)

    times = []
    peaks = []  # warm-up steps after the first: peak resident size over the start (as train_gpt's)
    losses_seen = []
    for step in range(args.warmup + args.steps):
        x, y = batch(tokens, step * args.batch, args.batch, args.seq_len, args.data_seed)
        probe = 0 < step < args.warmup  # not timed: the trim costs page faults
        rss_at_start = reset_peak_rss() if probe else 0
        start = time.perf_counter()
        optimizer.zero_grad()
        losses = []
        schedule.step(*([x] if holds_first else []), **({"target": y, "losses": losses} if holds_last else {}))
        if holds_last:
            losses_seen.append(float(sum(l.item() for l in losses) / len(losses)))
        optimizer.step()
        times.append(time.perf_counter() - start)
        if probe:
            peaks.append(max(0, status_bytes("VmHWM:") - rss_at_start))
    dist.barrier()
    measured = times[args.warmup:]
    memory = {"rank": args.rank, "step_peak_rss_over_start_bytes": statistics.median(peaks) if peaks else -1}
    if holds_last:
        memory.update({"schedule": args.schedule, "step_time_s": statistics.median(measured),
                       "first_loss": losses_seen[0], "last_loss": losses_seen[-1]})
    print(json.dumps(memory), flush=True)
    dist.destroy_process_group()


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss():
    """Hands the heap's free memory back (glibc's malloc_trim), resets VmHWM to
    the current resident size (Linux) and returns that size."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS:")


if __name__ == "__main__":
    main()
