"""The example GPT in Python, piece for piece the C++ one (examples/gpt/
gpt_model.cpp): the same pieces ("embed", "block<i>", "head"), parameter
names, initialisation (drawn in the same order from the generator the runtime
seeds per piece) and forward, so a checkpoint of one loads in the other. And
the same character-level data (examples/gpt/char_dataset.cpp): sample k of a
run is a window whose position depends on (seed, k) only.
"""
import os

import torch
import torch.nn.functional as F

MASK64 = (1 << 64) - 1


class GptConfig:
    def __init__(self, vocab_size=96, d_model=128, heads=4, layers=8, seq_len=64, dropout=0.0, seed=1234,
                 tie_embeddings=True, batch_norm=False):
        if d_model % heads != 0:
            raise ValueError("d_model %d is not divisible by heads %d" % (d_model, heads))
        self.vocab_size, self.d_model, self.heads, self.layers = vocab_size, d_model, heads, layers
        self.seq_len, self.dropout, self.seed = seq_len, dropout, seed
        self.tie_embeddings, self.batch_norm = tie_embeddings, batch_norm


def _init_linear(layer):
    """GPT-2 initialisation: N(0, 0.02) weights, zero biases."""
    with torch.no_grad():
        torch.nn.init.normal_(layer.weight, 0.0, 0.02)
        if layer.bias is not None:
            layer.bias.zero_()


class EmbeddingPiece(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = torch.nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = torch.nn.Embedding(c.seq_len, c.d_model)
        self.dropout = torch.nn.Dropout(c.dropout)
        with torch.no_grad():
            torch.nn.init.normal_(self.wte.weight, 0.0, 0.02)
            torch.nn.init.normal_(self.wpe.weight, 0.0, 0.02)

    def forward(self, activation, inputs):
        tokens = inputs["tokens"]
        positions = torch.arange(tokens.size(1), dtype=tokens.dtype, device=tokens.device)
        return self.dropout(self.wte(tokens) + self.wpe(positions))


class BlockPiece(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.attn_dropout = c.heads, c.dropout
        self.ln1 = torch.nn.LayerNorm(c.d_model)
        self.qkv = torch.nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = torch.nn.Linear(c.d_model, c.d_model)
        self.ln2 = torch.nn.LayerNorm(c.d_model)
        self.fc = torch.nn.Linear(c.d_model, 4 * c.d_model)
        self.fc2 = torch.nn.Linear(4 * c.d_model, c.d_model)
        self.dropout = torch.nn.Dropout(c.dropout)
        for layer in (self.qkv, self.proj, self.fc, self.fc2):
            _init_linear(layer)
        # Last and only when asked for, as in C++: the other draws come first.
        self.bn = torch.nn.BatchNorm1d(c.d_model) if c.batch_norm else None

    def forward(self, x, inputs):
        b, t, d = x.shape
        if self.bn is not None:
            x = self.bn(x.reshape(b * t, d)).view(b, t, d)
        q, k, v = self.qkv(self.ln1(x)).split(d, 2)

        def heads(y):
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        attn = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), None,
                                              self.attn_dropout if self.training else 0.0, True)
        h = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(b, t, d)))
        return h + self.dropout(self.fc2(F.gelu(self.fc(self.ln2(h)))))


class HeadPiece(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.vocab = c.vocab_size
        self.ln_f = torch.nn.LayerNorm(c.d_model)
        self.lm_head = torch.nn.Linear(c.d_model, c.vocab_size, bias=False)
        _init_linear(self.lm_head)

    def forward(self, x, inputs):
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, self.vocab), inputs["targets"].reshape(-1))


def gpt_pieces(c):
    """[(name, factory, parameter count)] and the shared-weight pairs, as makeGptModel."""
    d = c.d_model
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + \
        (2 * d if c.batch_norm else 0)
    pieces = [("embed", lambda: EmbeddingPiece(c), (c.vocab_size + c.seq_len) * d)]
    pieces += [("block%d" % i, lambda: BlockPiece(c), block) for i in range(c.layers)]
    pieces.append(("head", lambda: HeadPiece(c), 2 * d + c.vocab_size * d))
    shared = [("embed.wte.weight", "head.lm_head.weight")] if c.tie_embeddings else []
    return pieces, shared


def _splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class CharDataset:
    """Characters of real English text; the same samples as the C++ CharDataset."""

    def __init__(self, text):
        # Ordered as the C++ std::set<char> orders them: char is signed there,
        # so bytes from 0x80 up come first.
        vocab = sorted(set(text), key=lambda ch: ord(ch) - 256 if ord(ch) >= 128 else ord(ch))
        self.vocab_size = len(vocab)
        index = {ch: i for i, ch in enumerate(vocab)}
        self.tokens = torch.tensor([index[ch] for ch in text], dtype=torch.long)

    @classmethod
    def from_path(cls, path):
        data = b""
        if os.path.isdir(path):
            for name in sorted(os.listdir(path)):  # regular files, links skipped, sorted by name as in C++
                full = os.path.join(path, name)
                if os.path.isfile(full) and not os.path.islink(full):
                    with open(full, "rb") as f:
                        data += f.read()
        elif os.path.isfile(path):
            with open(path, "rb") as f:
                data = f.read()
        if len(data) < 1024:
            raise ValueError("training text '%s' is missing or smaller than 1 KiB; pass --data with a text file or "
                             "a directory of text files" % path)
        return cls(data.decode("latin-1"))  # byte-wise, as the C++ reads chars

    def samples(self, first, count, seq_len, seed):
        windows = len(self.tokens) - seq_len - 1
        if windows <= 0:
            raise ValueError("text of %d characters is too short for seq_len %d" % (len(self.tokens), seq_len))
        offsets = [_splitmix64(((seed * 0x100000001B3) & MASK64) ^ (first + s)) % windows for s in range(count)]
        idx = torch.tensor(offsets, dtype=torch.long).unsqueeze(1) + torch.arange(seq_len + 1).unsqueeze(0)
        window = self.tokens[idx]
        return {"tokens": window[:, :-1].contiguous(), "targets": window[:, 1:].contiguous()}

    def replica_batch(self, step, global_batch, replica, replicas, seq_len, seed):
        share = global_batch // replicas
        return self.samples(step * global_batch + replica * share, share, seq_len, seed)


__all__ = ["GptConfig", "gpt_pieces", "CharDataset", "EmbeddingPiece", "BlockPiece", "HeadPiece"]
