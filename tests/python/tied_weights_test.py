#!/usr/bin/env python3
"""One Parameter held by two pieces (an embedding tied to its output layer the
usual PyTorch way, `head.weight = embed.weight`), from the Python front end:

  declared      with shared_weights naming the pair, (P,D) in (1,1) (1,2)
                (2,1) (2,2) train exactly like the plain loop of the same
                tied model (losses and parameters, rtol 1e-5): on one stage
                it is one parameter (stepped once, reduced once), on two
                stages two copies kept equal
  undeclared    without the pair, every layout refuses the model at
                construction (exit 2) with a message naming both parameters,
                a Sequential (checked whole) and pieces given as factories
                (checked per stage by the runtime)

    tied_weights_test.py [name ...]
    tied_weights_test.py --worker --out DIR [--undeclared] [--factories]   (one rank; run by the test)
"""
import argparse
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checks  # noqa: E402

VOCAB, WIDTH, SEQ = 11, 8, 5
GLOBAL_BATCH, MICRO, STEPS = 8, 2, 3
PAIR = ("embed.table.weight", "head.out.weight")
failures = checks.failures


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(VOCAB, WIDTH)

    def forward(self, activation, inputs):
        return self.table(inputs["tokens"])


class Mix(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, activation, inputs):
        return activation + torch.tanh(self.linear(activation))


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, activation, inputs):
        logits = self.out(activation)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), inputs["targets"].reshape(-1))


def tied_model():
    torch.manual_seed(3)
    model = torch.nn.Sequential()
    model.add_module("embed", Embed())
    model.add_module("mix", Mix())
    model.add_module("head", Head())
    model.head.out.weight = model.embed.table.weight  # one Parameter, two pieces
    return model


def global_batch(step):
    gen = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    return {"tokens": tokens, "targets": torch.roll(tokens, 1, dims=1)}


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=0.01)


def reference():
    model = tied_model()
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        batch = global_batch(step)
        activation = None
        for child in model:
            activation = child(activation, batch)
        opt.zero_grad()
        activation.backward()
        opt.step()
        losses.append(activation.item())
    params = {"%s.%s" % (c, n): p.detach().clone() for c, child in model.named_children()
              for n, p in child.named_parameters(remove_duplicate=False)}
    return losses, params


def worker(argv):
    import varuna
    launch = varuna.get_launch_args()
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--undeclared", action="store_true")
    parser.add_argument("--factories", action="store_true", help="pieces as (name, factory), not a Sequential")
    args = parser.parse_args(launch.user_args)
    built = tied_model()
    pieces = [(name, (lambda child=child: child)) for name, child in built.named_children()] if args.factories else built
    try:
        model = varuna.Varuna(pieces, get_batch_fn=lambda size, device: {
                                  k: v[:size].to(device) for k, v in global_batch(0).items()},
                              batch_size=GLOBAL_BATCH, launch_args=launch, peer_timeout_s=20,
                              shared_weights=[] if args.undeclared else [PAIR])
        model.set_optimizer(make_optimizer(model.parameters()))
        share = GLOBAL_BATCH // model.num_replicas
        losses = []
        for step in range(STEPS):
            batch = global_batch(step)
            losses.append(model.step({k: v[model.replica * share:(model.replica + 1) * share]
                                      for k, v in batch.items()}).loss)
        os.makedirs(args.out, exist_ok=True)
        torch.save({"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "optimizer_params": len(list(model.parameters()))},
                   os.path.join(args.out, "rank_%d.pt" % launch.rank))
    except Exception as error:  # noqa: BLE001 - every failure ends the worker with its code
        varuna.exit_after_failure(error)


def run_job(out, stages, replicas, *worker_args):
    return checks.launch(os.path.abspath(__file__), stages, replicas, MICRO, GLOBAL_BATCH,
                         ["--worker", "--out", out] + list(worker_args))


def test_declared_pair_trains_like_the_plain_loop():
    ref_losses, ref_params = reference()
    for stages, replicas in [(1, 1), (1, 2), (2, 1), (2, 2)]:
        what = "%dx%d" % (stages, replicas)
        with tempfile.TemporaryDirectory() as out:
            proc = run_job(out, stages, replicas)
            if proc.returncode != 0:
                failures.append("%s failed (%d): %s" % (what, proc.returncode, proc.stderr[-2000:]))
                continue
            params, losses = {}, None
            for rank in range(stages * replicas):
                part = torch.load(os.path.join(out, "rank_%d.pt" % rank))
                losses = part["losses"]
                params.update(part["params"])
                if stages == 1 and part["optimizer_params"] != 3:  # the table (= head.out.weight), mix.linear x2
                    failures.append("%s: the optimizer got %d parameters, not 3 (the tied one once)"
                                    % (what, part["optimizer_params"]))
        if any(abs(a - b) > 1e-5 * max(1.0, abs(b)) for a, b in zip(losses, ref_losses)):
            failures.append("%s: losses %s vs the plain loop's %s" % (what, losses, ref_losses))
        if stages == 1 and PAIR[1] in params:
            failures.append("%s: named_parameters() lists the tied tensor twice" % what)
        for name, tensor in ref_params.items():
            if name == PAIR[1] and name not in params and stages == 1:
                name = PAIR[0]  # one tensor on one stage: listed once, under its first name
            if name not in params:
                failures.append("%s: no parameter %s" % (what, name))
            elif not torch.allclose(params[name], tensor, rtol=1e-5, atol=1e-6):
                failures.append("%s: %s differs by %.3g" % (what, name, (params[name] - tensor).abs().max().item()))


def test_undeclared_pair_is_refused_in_every_layout():
    # A Sequential is checked whole, in Python; pieces given as factories are
    # checked per stage by the runtime (there both are on the one stage).
    for stages, form in [(1, []), (2, []), (1, ["--factories"])]:
        what = "P=%d %s" % (stages, form[0] if form else "Sequential")
        with tempfile.TemporaryDirectory() as out:
            proc = run_job(out, stages, 1, "--undeclared", *form)
        if proc.returncode != 2:
            failures.append("%s: an undeclared tied Parameter ended with %d, not 2 (a ConfigError)"
                            % (what, proc.returncode))
        elif "%s' and '%s' are one tensor" % PAIR not in proc.stderr or "shared_weights" not in proc.stderr:
            failures.append("%s: the refusal does not name the pair and the fix: %s" % (what, proc.stderr[-1500:]))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv)
    else:
        checks.run(globals())
