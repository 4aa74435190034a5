"""A small model in Python pieces for the front end's tests, and the plain
single-process PyTorch loop it must match (frontend_test.py)."""
import torch

WIDTH = 16
N_PIECES = 4
SEED = 7


class InputPiece(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # A buffer (running statistics) follows P5's rules. On the inputs, not
        # after a layer: a BatchNorm after a Linear makes the Linear's gradient
        # partly numerical noise, which Adam and RMSprop amplify.
        self.norm = torch.nn.BatchNorm1d(8)
        self.proj = torch.nn.Linear(8, WIDTH)

    def forward(self, activation, inputs):
        return torch.tanh(self.proj(self.norm(inputs["x"])))


class HiddenPiece(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())

    def forward(self, activation, inputs):
        return activation + self.mlp(activation)


class LossPiece(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(WIDTH, 4)

    def forward(self, activation, inputs):
        return torch.nn.functional.mse_loss(self.head(activation), inputs["y"])


FACTORIES = [("embed", InputPiece), ("h1", HiddenPiece), ("h2", HiddenPiece), ("head", LossPiece)]


def pieces():
    return list(FACTORIES)


def global_batch(step, size):
    gen = torch.Generator().manual_seed(1000 + step)
    return {"x": torch.randn(size, 8, generator=gen), "y": torch.randn(size, 4, generator=gen)}


def teacher_batch(step, size):
    """A learnable task: the targets are a fixed function of the inputs."""
    gen = torch.Generator().manual_seed(2000 + step)
    teacher = torch.randn(8, 4, generator=torch.Generator().manual_seed(99)) / 2
    x = torch.randn(size, 8, generator=gen)
    return {"x": x, "y": torch.tanh(x @ teacher)}


def get_batch(size, device):
    return {k: v.to(device) for k, v in global_batch(0, size).items()}


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=0.005, momentum=0.5)
    raise ValueError(name)


def reference(steps, global_size, optimizer, micro, first_step=0, state=None, batch_fn=global_batch,
              skip_steps=()):
    """The plain loop: each piece built after manual_seed(SEED + index), one
    process, the same global batches; gradients as the runtime makes them
    (the mean over the micro-batches of each micro-batch's mean loss).
    batch_fn(step, size) gives the global batches (default global_batch);
    the steps in skip_steps compute their loss but change nothing (as an fp16
    overflow does).
    Returns the losses, the parameters by full name and the held-out loss."""
    modules = []
    for i, (name, factory) in enumerate(FACTORIES):
        torch.manual_seed(SEED + i)
        modules.append((name, factory()))
    model = torch.nn.ModuleList([m for _, m in modules])
    opt = make_optimizer(optimizer, list(model.parameters()))
    losses = []
    for step in range(first_step, first_step + steps):
        batch = batch_fn(step, global_size)
        opt.zero_grad()
        total = 0.0
        n = global_size // micro
        for k in range(n):
            chunk = {key: v[k * micro:(k + 1) * micro] for key, v in batch.items()}
            activation = None
            for m in model:
                activation = m(activation, chunk)
            (activation / n).backward()
            total += activation.item() / n
        if step not in skip_steps:
            opt.step()
        losses.append(total)
    named = {}
    for name, m in modules:
        for pname, p in m.named_parameters():
            named["%s.%s" % (name, pname)] = p.detach().clone()
    # Held out: the global batch after the last step, in eval mode.
    model.eval()
    with torch.no_grad():
        activation = None
        for m in model:
            activation = m(activation, batch_fn(first_step + steps, global_size))
    return losses, named, activation.item()
