"""A GPT-2-style model written the manual's way (docs/python.md, "CutPoints"):
one ordinary torch.nn.Module whose forward(tokens, targets) returns the loss,
with varuna.CutPoint calls where it may be cut. varuna.Varuna and
varuna.Profiler split it there into the pieces "piece0" (the embeddings),
"piece1".."piece<L>" (the blocks) and "piece<L+1>" (the final LayerNorm and
the LM head). train_gpt2_cutpoints.py trains and profiles it.

What the manual's rules ask of it, and how it answers:
- the CutPoints live in a plain list and are called in forward, one per
  possible boundary, each on the one tensor (batch first) that crosses it;
- the causal attention mask and the position ids are made from the inputs
  alone (torch.arange comparisons: torch.fx cannot trace torch.ones(T, T)
  with a traced T), so every piece that needs them recomputes them;
- the LM head's weight is tied to the token embedding the manual's way: its
  own nn.Parameter, the pair named in SHARED_WEIGHTS (the runtime keeps the
  two equal, on one stage or on two).
"""
import math

import torch
import torch.nn.functional as F
import varuna

# The tie, by the model's own parameter names.
SHARED_WEIGHTS = [("wte.weight", "lm_head_weight")]


class Block(torch.nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a 4x MLP."""

    def __init__(self, d_model, heads, dropout):
        super().__init__()
        if d_model % heads != 0:
            raise ValueError("d_model %d is not divisible by heads %d" % (d_model, heads))
        self.heads, self.head_dim = heads, d_model // heads
        self.ln1 = torch.nn.LayerNorm(d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.ln2 = torch.nn.LayerNorm(d_model)
        self.fc = torch.nn.Linear(d_model, 4 * d_model)
        self.fc2 = torch.nn.Linear(4 * d_model, d_model)
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x, allowed):
        # Shapes by unflatten/flatten, not by x.shape unpacking: symbolic
        # tracing cannot iterate over a traced size.
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~allowed, float("-inf"))
        attn = self.dropout(torch.softmax(scores, dim=-1)) @ v
        h = x + self.dropout(self.proj(attn.transpose(1, 2).flatten(2)))
        return h + self.dropout(self.fc2(F.gelu(self.fc(self.ln2(h)))))


class GPT2(torch.nn.Module):
    def __init__(self, vocab_size, d_model=128, heads=4, layers=8, seq_len=64, dropout=0.0):
        super().__init__()
        self.vocab_size = vocab_size
        self.wte = torch.nn.Embedding(vocab_size, d_model)
        self.wpe = torch.nn.Embedding(seq_len, d_model)
        self.drop = torch.nn.Dropout(dropout)
        self.blocks = torch.nn.ModuleList([Block(d_model, heads, dropout) for _ in range(layers)])
        # Before every block and before the head: the manual keeps them in a
        # plain list (not registered as submodules).
        self.cutpoints = [varuna.CutPoint() for _ in range(layers + 1)]
        self.ln_f = torch.nn.LayerNorm(d_model)
        # Tied to wte.weight through SHARED_WEIGHTS: a separate Parameter,
        # since the embedding and the head may be on different stages.
        self.lm_head_weight = torch.nn.Parameter(torch.empty(vocab_size, d_model))
        with torch.no_grad():
            self.lm_head_weight.copy_(self.wte.weight)

    def forward(self, tokens, targets):
        length = tokens.size(1)
        positions = torch.arange(length, device=tokens.device)        # from the inputs alone
        allowed = positions[None, :] <= positions[:, None]            # causal: key <= query
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        for cut, block in zip(self.cutpoints, self.blocks):
            x = cut(x)
            x = block(x, allowed)
        x = self.cutpoints[-1](x)
        logits = self.ln_f(x) @ self.lm_head_weight.t()
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1))


def init_fn(name, module):
    """GPT-2's initialisation, per submodule and of its own parameters only
    (what varuna calls for each submodule of a model built on the meta
    device, and what varuna.initialize applies to one built normally):
    N(0, 0.02) matrices and embeddings, zero biases, unit LayerNorm scales."""
    for pname, p in module.named_parameters(recurse=False):
        if p.dim() > 1:
            torch.nn.init.normal_(p, 0.0, 0.02)
        elif pname == "bias":
            torch.nn.init.zeros_(p)
        else:
            torch.nn.init.ones_(p)


def build(vocab_size, d_model=128, heads=4, layers=8, seq_len=64, dropout=0.0, seed=1234, meta=False):
    """The model with the weights init_fn gives under `seed`: built on the
    meta device (no memory; varuna materialises each rank's pieces and calls
    init_fn on them), or normally and initialised the same way at once."""
    if meta:
        with torch.device("meta"):
            return GPT2(vocab_size, d_model, heads, layers, seq_len, dropout)
    model = GPT2(vocab_size, d_model, heads, layers, seq_len, dropout)
    with torch.no_grad():
        varuna.initialize(model, init_fn, seed)
    return model


__all__ = ["GPT2", "Block", "SHARED_WEIGHTS", "init_fn", "build"]
