"""The pip-installed varuna package, run from its install target only
(install_test.sh: PYTHONPATH=SITE, no build tree on the path). In one process
(world size 1 from the environment, CPU, the store on a free port) it trains a
two-piece model and fails unless
  - varuna and its extension are the ones under SITE, imported before torch
    (the extension finds libtorch by itself),
  - the losses and the parameters after training equal a plain PyTorch loop's
    on the same batches (rtol 1e-5),
  - the loss fell (the last step's below a quarter of the first's).

    train_tiny.py SITE
"""
import os
import sys

SITE = os.path.realpath(sys.argv[1])

import varuna  # noqa: E402 - first: the extension must load without `import torch` before it
import torch  # noqa: E402

GLOBAL_BATCH, MICRO, STEPS, SEED, LR, MOMENTUM = 16, 4, 12, 11, 0.05, 0.9
failures = []


def under_site(path):
    return os.path.realpath(path).startswith(SITE + os.sep)


for module in (varuna, varuna._C):
    if not under_site(module.__file__):
        failures.append("%s was imported from %s, not from %s" % (module.__name__, module.__file__, SITE))


class Hidden(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 16)

    def forward(self, activation, inputs):
        return torch.tanh(self.fc(inputs["x"]))


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(16, 4)

    def forward(self, activation, inputs):
        return torch.nn.functional.mse_loss(self.out(activation), inputs["y"])


PIECES = [("hidden", Hidden), ("head", Head)]


def batch_at(step, size):
    """Deterministic inputs, different at every step; y a fixed function of x."""
    x = torch.sin(torch.arange(size * 8, dtype=torch.float32).reshape(size, 8) * 0.37 + 1.3 * step)
    w = torch.linspace(-1.0, 1.0, 32).reshape(8, 4)
    return {"x": x, "y": 0.5 * (x @ w)}


def reference():
    """The plain loop: piece i built after manual_seed(SEED + i), as the
    runtime builds it; the gradient is the mean over the micro-batches."""
    modules = []
    for i, (_, factory) in enumerate(PIECES):
        torch.manual_seed(SEED + i)
        modules.append(factory())
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=LR, momentum=MOMENTUM)
    losses, n = [], GLOBAL_BATCH // MICRO
    for step in range(STEPS):
        batch = batch_at(step, GLOBAL_BATCH)
        opt.zero_grad()
        total = 0.0
        for k in range(n):
            chunk = {key: v[k * MICRO:(k + 1) * MICRO] for key, v in batch.items()}
            activation = None
            for m in modules:
                activation = m(activation, chunk)
            (activation / n).backward()
            total += activation.item() / n
        opt.step()
        losses.append(total)
    params = {"%s.%s" % (name, pname): p.detach().clone()
              for (name, _), m in zip(PIECES, modules) for pname, p in m.named_parameters()}
    return losses, params


torch.set_num_threads(1)
varuna.install_checkpoint_signal_handler()
launch = varuna.get_launch_args([sys.argv[0]])
model = varuna.Varuna(PIECES, get_batch_fn=lambda size, device: batch_at(0, size), batch_size=GLOBAL_BATCH,
                      chunk_size=MICRO, launch_args=launch, seed=SEED)
if (model.num_stages, model.num_replicas, model.rank) != (1, 1, 0):
    failures.append("expected rank 0 of 1 stage x 1 replica, got %s" % ((model.num_stages, model.num_replicas,
                                                                          model.rank),))
model.set_optimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
ref_losses, ref_params = reference()
losses = []
for step in range(STEPS):
    loss, overflow, grad_norm = model.step(batch_at(step, GLOBAL_BATCH))
    print("step %d loss %.6f (plain loop %.6f)" % (step, loss, ref_losses[step]), flush=True)
    losses.append(loss)
    if not abs(loss - ref_losses[step]) <= 1e-5 * max(1.0, abs(ref_losses[step])):
        failures.append("step %d: loss %r, the plain loop's %r" % (step, loss, ref_losses[step]))
params = dict(model.named_parameters())
if set(params) != set(ref_params):
    failures.append("parameters %s, the plain loop's %s" % (sorted(params), sorted(ref_params)))
else:
    for name, tensor in ref_params.items():
        if not torch.allclose(params[name], tensor, rtol=1e-5, atol=1e-6):
            failures.append("%s differs by %.3g" % (name, (params[name] - tensor).abs().max().item()))
if not losses[-1] < 0.25 * losses[0]:
    failures.append("the loss did not fall: %r -> %r" % (losses[0], losses[-1]))

for failure in failures:
    print("FAIL: " + failure, file=sys.stderr)
print("ok" if not failures else "FAILED", flush=True)
sys.exit(1 if failures else 0)
