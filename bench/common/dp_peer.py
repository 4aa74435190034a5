"""The data-parallel peer's pieces that bench/morph/peer_dp.py and
bench/goodput/peer_ddp.py share: the example GPT in one process, its token
ids, their common arguments, the per-worker event file, checkpoint save and
resume, and one DDP step on a fixed global batch. The two workers differ
only in when rank 0 checkpoints and in what they record, so that is all each
keeps.

Imported after `import torch` by workers torchrun starts (peer_dp.py times
that import; nothing here runs at import but the imports).
"""
import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# bench/peer_gpt.py: the example GPT's block and train_gpt's sampler.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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


def peer_parser(ckpt_help, steps, batch):
    """The arguments both workers take; each adds its own."""
    p = argparse.ArgumentParser()
    p.add_argument("--events", required=True, help="folder for the per-worker event files")
    p.add_argument("--ckpt", required=True, help=ckpt_help)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=batch, help="global batch, split over the workers")
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data", default="/usr/share/common-licenses")
    p.add_argument("--data_seed", type=int, default=7)
    return p


class EventLog:
    """<folder>/rank<r>.<pid>.jsonl: one JSON line per milestone, each with its Unix time "t", the
    worker's rank, world size and pid, and `fields` (the same on every line). Line-buffered: a
    SIGKILLed worker loses at most the line it was writing, which the bench skips."""

    def __init__(self, folder, rank, world, **fields):
        self.out = open(os.path.join(folder, "rank%d.%d.jsonl" % (rank, os.getpid())), "a", buffering=1)
        self.fields = dict(rank=rank, world=world, **fields, pid=os.getpid())

    def record(self, event, t=None, **fields):
        self.out.write(json.dumps({"event": event, "t": t or time.time(), **self.fields, **fields}) + "\n")

    def flush(self):
        self.out.flush()


def build_model(args):
    """(tokens, vocab, model, optimizer), one thread, the same initial weights on every worker (DDP
    broadcasts rank 0's anyway)."""
    torch.set_num_threads(1)
    tokens, vocab = load_tokens(args.data)
    torch.manual_seed(1234)
    model = Gpt(vocab, args.d_model, args.layers, args.heads, args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    return tokens, vocab, model, optimizer


def init_group():
    # A lost peer shows up as a closed connection at once; the timeout only bounds a silent hang.
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))


def resume(path, model, optimizer):
    """Loads the checkpoint at path if there is one; returns the steps it holds (0 without one)."""
    if not os.path.exists(path):
        return 0
    state = torch.load(path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def save(path, model, optimizer, steps):
    """Writes a temp file, then renames it: a worker killed mid-write leaves the previous checkpoint."""
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": steps}, tmp)
    os.replace(tmp, path)


def share_of(batch, world):
    """Each worker's part of the fixed global batch: losing workers makes the survivors' parts larger."""
    if batch % world:
        raise SystemExit("--batch %d does not split over %d workers" % (batch, world))
    return batch // world


def train_step(ddp, optimizer, tokens, vocab, args, step, rank, share):
    """Step `step` (counted from 0) on this worker's part of its global batch; returns the loss.
    The samples depend on the step only, so a resumed job sees what an uninterrupted one would."""
    x, y = samples(tokens, step * args.batch + rank * share, share, args.seq_len, args.data_seed)
    optimizer.zero_grad()
    loss = F.cross_entropy(ddp(x).reshape(-1, vocab), y.reshape(-1))
    loss.backward()
    optimizer.step()
    return loss
