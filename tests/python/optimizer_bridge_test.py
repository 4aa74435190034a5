#!/usr/bin/env python3
"""varuna.optimizer.OptimizerBridge in one process (no runtime): the state it
saves and restores resumes a torch.optim optimizer exactly, for the plain,
foreach and fused forms (fused keeps `step` where its kernel wants it), and it
refuses state of the wrong shape.

    optimizer_bridge_test.py [name ...]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks  # noqa: E402
from varuna.optimizer import OptimizerBridge  # noqa: E402

failures = checks.failures


def train(params, optimizer, steps, first=0):
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()


def fresh_params():
    torch.manual_seed(1)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


def test_resume_is_exact_for_every_form():
    forms = {"plain": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
    for kind in (torch.optim.Adam, torch.optim.AdamW):
        for form, options in forms.items():
            what = "%s %s" % (kind.__name__, form)
            straight = fresh_params()
            opt = kind(straight, lr=0.05, **options)
            train(straight, opt, 4)

            first = fresh_params()
            opt_a = kind(first, lr=0.05, **options)
            train(first, opt_a, 2)
            names = [("w", first[0]), ("b", first[1])]
            saved = dict(OptimizerBridge(opt_a).state(names))
            settings = OptimizerBridge(opt_a).settings_json()

            resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
            opt_b = kind(resumed, lr=0.05, **options)
            bridge = OptimizerBridge(opt_b)
            bridge.check_settings_json(settings)
            bridge.apply_settings_json(settings)
            bridge.decode_state([("w", resumed[0]), ("b", resumed[1])], saved, "test")()
            step = opt_b.state[resumed[0]]["step"]
            if step.dtype != torch.float32 or step.device != resumed[0].device or step.dim() != 0:
                failures.append("%s: step restored as %s %s %s" % (what, step.dtype, step.device, step.shape))
            train(resumed, opt_b, 2, first=2)
            for a, b in zip(straight, resumed):
                if not torch.equal(a, b):
                    failures.append("%s: resumed differs by %.3g" % (what, (a - b).abs().max().item()))


def test_wrong_shape_is_refused():
    params = fresh_params()
    opt = torch.optim.Adam(params, lr=0.1)
    train(params, opt, 1)
    saved = dict(OptimizerBridge(opt).state([("w", params[0])]))
    other = torch.nn.Parameter(torch.randn(5, 3))
    try:
        OptimizerBridge(torch.optim.Adam([other], lr=0.1)).decode_state([("w", other)], saved, "ckpt/x")
        failures.append("state of shape (4, 3) was accepted for a (5, 3) parameter")
    except ValueError as error:
        if "'w'" not in str(error) or "ckpt/x" not in str(error):
            failures.append("the refusal does not name the parameter and the file: %s" % error)


if __name__ == "__main__":
    checks.run(globals())
