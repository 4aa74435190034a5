"""The example GPT's building blocks and data sampler in plain PyTorch, shared
by the benchmarks' peers (bench/pipeline/peer_pipelining.py, and
bench/common/dp_peer.py used by bench/morph and bench/goodput). They mirror
examples/gpt/gpt_model.cpp and char_dataset.cpp so peer and runtime train the
same model on the same samples."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """The example GPT's block (examples/gpt/gpt_model.cpp)."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, 2)
        heads = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        h = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.fc2(F.gelu(self.fc(self.ln2(h))))


def load_text(path):
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path))
        files = [f for f in files if os.path.isfile(f) and not os.path.islink(f)]
    else:
        files = [path]
    return b"".join(open(f, "rb").read() for f in files)


MASK = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def batch(tokens, first, count, seq, seed):
    """Same sampler as examples/gpt/char_dataset.cpp: sample k starts at
    splitmix64(seed * 0x100000001b3 ^ k) mod (len - seq - 1)."""
    windows = len(tokens) - seq - 1
    rows = []
    for k in range(first, first + count):
        off = splitmix64(((seed * 0x100000001B3) & MASK) ^ k) % windows
        rows.append(tokens[off:off + seq + 1])
    data = torch.stack(rows)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()
