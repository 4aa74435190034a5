#!/usr/bin/env python3
"""The CutPoint split on model code the symbolic tracer could not follow,
and PyTorch's own way of tying weights:

  real code          a model with shape unpacking (b, t, d = x.shape;
                     x.view(*x.shape[:-1], heads, -1)), blocks taking *args
                     and keyword arguments, an assert on a shape, Python
                     control flow on configuration values, and a dataclass
                     as the forward's result trains as 2x1 and 2x2 exactly as
                     the plain module (rtol 1e-5)
  ties               the decoder's weight the very same Parameter as the
                     embedding's (self.dec_weight = self.embed.weight),
                     declared in shared_weights or not, trains exactly; the
                     two names stay one weight on every rank
  evaluation         evaluate() runs the forward captured in evaluation mode
                     (dropout off, BatchNorm's running statistics, a branch
                     on self.training): the plain module's eval-mode loss
  data-dependent     a branch on a tensor's value is refused at
                     construction, naming this file, the line and the cause

    split_test.py [name ...]
    split_test.py --worker --out DIR --model NAME [--declare]   (one rank)
"""
import argparse
import dataclasses
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checks  # noqa: E402
import varuna  # noqa: E402

VOCAB, SEQ, WIDTH, HEADS, BLOCKS = 17, 6, 16, 2, 4
GLOBAL_BATCH, MICRO, STEPS = 8, 2, 3
failures = checks.failures


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class Block(torch.nn.Module):
    def __init__(self, gated):
        super().__init__()
        self.gated = gated
        self.ln = torch.nn.LayerNorm(WIDTH)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x, *extra, scale=1.0):
        b, t, d = x.shape  # shape unpacking
        assert d == WIDTH, "a block takes WIDTH features"
        q, k, v = (part.view(*part.shape[:-1], HEADS, -1).transpose(1, 2)
                   for part in self.qkv(self.ln(x)).chunk(3, dim=-1))
        mask = extra[0] if extra else None
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d)) * scale
        hidden = self.up(x)
        if self.gated:  # control flow on configuration
            hidden = hidden * torch.sigmoid(hidden)
        return x + self.down(hidden)


class RealCode(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(gated=i % 2 == 0) for i in range(BLOCKS)])
        self.cuts = [varuna.CutPoint() for _ in range(BLOCKS)]
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids, targets):
        length = input_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        x = self.embed(input_ids)
        for i in range(len(self.blocks)):
            x = self.cuts[i](x)
            x = self.blocks[i](x, causal, scale=0.5)
        logits = self.head(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        return Output(loss=loss, logits=logits)


class PyTorchTie(torch.nn.Module):
    """The decoder weight is the embedding's Parameter, as PyTorch ties."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS)])
        self.cuts = [varuna.CutPoint() for _ in range(BLOCKS)]
        self.dec_weight = self.embed.weight

    def forward(self, input_ids, targets):
        x = self.embed(input_ids)
        for cut, block in zip(self.cuts, self.blocks):
            x = torch.tanh(block(cut(x)))
        return torch.nn.functional.cross_entropy((x @ self.dec_weight.t()).reshape(-1, VOCAB), targets.reshape(-1))


class ModeDependent(torch.nn.Module):
    """Dropout, BatchNorm and a branch on self.training: evaluation differs."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.norms = torch.nn.ModuleList([torch.nn.BatchNorm1d(WIDTH) for _ in range(BLOCKS)])
        self.drop = torch.nn.Dropout(0.5)
        self.cuts = [varuna.CutPoint() for _ in range(BLOCKS)]
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids, targets):
        x = self.embed(input_ids)
        for cut, norm in zip(self.cuts, self.norms):
            x = cut(x)
            x = self.drop(norm(x.transpose(1, 2)).transpose(1, 2))
            if self.training:
                x = x * 1.5
        return torch.nn.functional.cross_entropy(self.head(x).reshape(-1, VOCAB), targets.reshape(-1))


class DataDependent(RealCode):
    def forward(self, input_ids, targets):
        x = self.embed(input_ids)
        for i in range(len(self.blocks)):
            x = self.cuts[i](x)
            if x.mean() > 0:  # DATA-DEPENDENT
                x = self.blocks[i](x)
        return torch.nn.functional.cross_entropy(self.head(x).reshape(-1, VOCAB), targets.reshape(-1))


MODELS = {"real_code": RealCode, "tie": PyTorchTie, "modes": ModeDependent}


def build(name):
    torch.manual_seed(5)
    return MODELS[name]()


def global_batch(step, size):
    gen = torch.Generator().manual_seed(40 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
    return {"input_ids": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}


def get_batch(size, device):
    return {k: v.to(device) for k, v in global_batch(0, size).items()}


def plain(name):
    model = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        out = model(**global_batch(step, GLOBAL_BATCH))
        loss = out.loss if isinstance(out, Output) else out
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def worker():
    launch = varuna.get_launch_args()
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--declare", action="store_true", help="name the tie in shared_weights")
    parser.add_argument("--evaluate_only", action="store_true", help="evaluate the initial model, no training")
    args = parser.parse_args(launch.user_args)
    try:
        shared = [("embed.weight", "dec_weight")] if args.declare else None
        model = varuna.Varuna(build(args.model), launch.stage_to_rank_map, get_batch, GLOBAL_BATCH, launch.chunk_size,
                              launch_args=launch, shared_weights=shared, peer_timeout_s=60)
        model.set_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        share = GLOBAL_BATCH // model.num_replicas
        if args.evaluate_only:
            batch = global_batch(0, GLOBAL_BATCH)
            loss = model.evaluate({k: v[model.replica * share:(model.replica + 1) * share] for k, v in batch.items()})
            torch.save({"eval_loss": loss}, os.path.join(args.out, "rank_%d.pt" % launch.rank))
            return
        losses = []
        for step in range(STEPS):
            batch = global_batch(step, GLOBAL_BATCH)
            losses.append(model.step({k: v[model.replica * share:(model.replica + 1) * share]
                                      for k, v in batch.items()}).loss)
        torch.save({"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
                   os.path.join(args.out, "rank_%d.pt" % launch.rank))
    except Exception as error:  # noqa: BLE001 - every failure ends the worker with its code
        varuna.exit_after_failure(error)


def check_layouts(name, *worker_args):
    ref_losses, ref_params = plain(name)
    for stages, replicas in [(2, 1), (2, 2)]:
        what = "%s %dx%d%s" % (name, stages, replicas, "".join(" " + a for a in worker_args))
        with tempfile.TemporaryDirectory() as out:
            proc = checks.launch(os.path.abspath(__file__), stages, replicas, MICRO, GLOBAL_BATCH,
                                 ["--worker", "--out", out, "--model", name] + list(worker_args))
            if proc.returncode != 0:
                failures.append("%s failed (%d): %s" % (what, proc.returncode, proc.stderr[-2500:]))
                continue
            parts = [torch.load(os.path.join(out, "rank_%d.pt" % r)) for r in range(stages * replicas)]
        params = {}
        for part in parts:
            params.update(part["params"])
        if any(abs(a - b) > 1e-5 * max(1.0, abs(b)) for a, b in zip(parts[0]["losses"], ref_losses)):
            failures.append("%s: losses %s vs the plain module's %s" % (what, parts[0]["losses"], ref_losses))
        if set(params) != set(ref_params):
            failures.append("%s: names %s vs the model's %s" % (what, sorted(params), sorted(ref_params)))
            continue
        for n, t in ref_params.items():
            if not torch.allclose(params[n], t, rtol=1e-5, atol=1e-6):
                failures.append("%s: %s differs by %.3g" % (what, n, (params[n] - t).abs().max().item()))


def test_real_model_code_trains_exactly():
    check_layouts("real_code")


def test_a_pytorch_tie_trains_as_one_weight():
    check_layouts("tie")
    check_layouts("tie", "--declare")


def test_evaluation_runs_the_evaluation_mode_graph():
    # Dropout off, BatchNorm on its running statistics, the branch on
    # self.training not taken: as the plain module in eval mode.
    model = build("modes").eval()
    with torch.no_grad():
        expected = model(**global_batch(0, GLOBAL_BATCH)).item()
    with tempfile.TemporaryDirectory() as out:
        proc = checks.launch(os.path.abspath(__file__), 2, 1, MICRO, GLOBAL_BATCH,
                             ["--worker", "--out", out, "--model", "modes", "--evaluate_only"])
        if proc.returncode != 0:
            raise AssertionError("the job failed (%d): %s" % (proc.returncode, proc.stderr[-2500:]))
        got = torch.load(os.path.join(out, "rank_0.pt"))["eval_loss"]
    if abs(got - expected) > 1e-5 * abs(expected):
        failures.append("evaluate() gave %r, the plain module in eval mode %r" % (got, expected))


def test_a_data_dependent_branch_is_refused_naming_the_line():
    launch = varuna.get_launch_args(["refusal"])
    try:
        varuna.Varuna(DataDependent(), "0;", get_batch, GLOBAL_BATCH, MICRO, launch_args=launch)
    except varuna.ConfigError as error:
        message = str(error)
    else:
        raise AssertionError("a branch on a tensor's value was accepted")
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if "# DATA-DEPENDENT" in text)
    expected = ["%s:%d" % (os.path.basename(__file__), line), "depends on a tensor's value", "x.mean() > 0"]
    missing = [e for e in expected if e not in message]
    if missing:
        failures.append("the refusal lacks %s: %s" % (missing, message))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        checks.run(globals())
