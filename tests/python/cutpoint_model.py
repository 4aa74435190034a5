"""A small GPT-2-style model written the manual's way (cutpoint_test.py): one
torch.nn.Module, CutPoints in a plain list called in its forward, an attention
mask and position ids made from the inputs, and the LM head's weight a
separate Parameter tied to the embedding through shared_weights."""
import math

import torch
import varuna

VOCAB, WIDTH, SEQ, BLOCKS = 13, 16, 6, 4
SHARED = [("wte.weight", "lm_head_weight")]


class Block(torch.nn.Module):
    def __init__(self, width=WIDTH):
        super().__init__()
        self.width = width
        self.ln = torch.nn.LayerNorm(width)
        # No bias: a key bias gets a gradient that is zero but for rounding,
        # which AdamW turns into full-size steps (the comparison would test
        # rounding, not the runtime).
        self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
        self.proj = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                       torch.nn.Linear(2 * width, width))

    def forward(self, x, mask):
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.width)
        scores = scores.masked_fill(mask, float("-inf"))
        x = x + self.proj(torch.softmax(scores, dim=-1) @ v)
        return x + self.mlp(x)


class ManualGPT(torch.nn.Module):
    def __init__(self, width=WIDTH, blocks=BLOCKS):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, width)
        self.wpe = torch.nn.Embedding(SEQ, width)
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(blocks)])
        self.cutpoints = [varuna.CutPoint() for _ in range(blocks)]  # a plain list, as in the manual
        self.ln_f = torch.nn.LayerNorm(width)
        # The manual's rule for a weight used at both ends: its own Parameter,
        # the pair named in shared_weights.
        self.lm_head_weight = torch.nn.Parameter(self.wte.weight.detach().clone())

    def forward(self, input_ids, targets):
        length = input_ids.size(1)
        positions = torch.arange(length, device=input_ids.device)  # from the inputs alone: any piece may use it
        mask = positions[None, :] > positions[:, None]  # causal; from the inputs alone too
        x = self.wte(input_ids) + self.wpe(positions)
        for i, block in enumerate(self.blocks):
            x = self.cutpoints[i](x)
            x = block(x, mask)
        logits = self.ln_f(x) @ self.lm_head_weight.t()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def build():
    torch.manual_seed(11)
    return ManualGPT()


def init_fn(name, module):
    """The initialisation a meta-built ManualGPT gets (and, through
    varuna.initialize, the plain reference): per submodule, its own
    parameters only."""
    for pname, p in module.named_parameters(recurse=False):
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
        elif pname == "bias":
            torch.nn.init.zeros_(p)
        else:
            torch.nn.init.ones_(p)


INIT_SEED = 5


def build_on_meta(width=WIDTH, blocks=BLOCKS):
    with torch.device("meta"):
        return ManualGPT(width, blocks)


def build_initialised():
    """What build_on_meta() becomes in the runtime, built whole."""
    model = ManualGPT()
    with torch.no_grad():
        varuna.initialize(model, init_fn, INIT_SEED)
    return model


def global_batch(step, size):
    gen = torch.Generator().manual_seed(900 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
    return {"input_ids": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}


def get_batch(size, device):
    return {k: v.to(device) for k, v in global_batch(0, size).items()}


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
