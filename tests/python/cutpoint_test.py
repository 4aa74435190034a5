#!/usr/bin/env python3
"""The manual's CutPoint form (varuna.CutPoint inside one nn.Module, split by
the package; cutpoint_model.py):

  equivalence   the manual-style GPT under (P,D) in (1,1) (2,1) (2,2) (4,1)
                trains like the same nn.Module in one plain process, with
                the tied pair truly one weight there (losses and every
                parameter, under the model's own names, rtol 1e-5)
  refusals      each broken model is refused at construction, before any
                process group, with a message naming the culprit: a value
                crossing a cut (and the line using it), a CutPoint called
                twice, a CutPoint never called, a parameter used on both
                sides of a cut, a shared-weight name the model lacks, a
                model without CutPoints

    cutpoint_test.py [name ...]
    cutpoint_test.py --worker --out DIR   (one rank; run by the test)
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.environ.get("VARUNA_SOURCE_DIR", os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
import checks  # noqa: E402
import cutpoint_model as cm  # noqa: E402
import varuna  # noqa: E402

GLOBAL_BATCH, MICRO, STEPS = 8, 2, 3
failures = checks.failures


def reference():
    model = cm.build()
    model.lm_head_weight = model.wte.weight  # one weight in the plain loop
    opt = cm.make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        loss = model(**cm.global_batch(step, GLOBAL_BATCH))
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
    args = parser.parse_args(launch.user_args)
    try:
        model = varuna.Varuna(cm.build(), launch.stage_to_rank_map, cm.get_batch, GLOBAL_BATCH, launch.chunk_size,
                              launch_args=launch, shared_weights=cm.SHARED, peer_timeout_s=20)
        model.set_optimizer(cm.make_optimizer(model.parameters()))
        share = GLOBAL_BATCH // model.num_replicas
        losses = []
        for step in range(STEPS):
            batch = cm.global_batch(step, GLOBAL_BATCH)
            losses.append(model.step({k: v[model.replica * share:(model.replica + 1) * share]
                                      for k, v in batch.items()}).loss)
        os.makedirs(args.out, exist_ok=True)
        torch.save({"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
                   os.path.join(args.out, "rank_%d.pt" % launch.rank))
    except Exception as error:  # noqa: BLE001 - every failure ends the worker with its code
        varuna.exit_after_failure(error)


def run_job(out, stages, replicas):
    cmd = [sys.executable, os.path.join(SOURCE, "scripts", "varuna_launch.py"), "--nstages", str(stages),
           "--replicas", str(replicas), "--chunk_size", str(MICRO), "--batch_size", str(GLOBAL_BATCH // replicas),
           "--grace", "30", "--", sys.executable, os.path.abspath(__file__), "--worker", "--out", out]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_equivalence_with_the_plain_module():
    ref_losses, ref_params = reference()
    for stages, replicas in [(1, 1), (2, 1), (2, 2), (4, 1)]:
        what = "%dx%d" % (stages, replicas)
        with tempfile.TemporaryDirectory() as out:
            proc = run_job(out, stages, replicas)
            if proc.returncode != 0:
                failures.append("%s failed (%d): %s" % (what, proc.returncode, proc.stderr[-2500:]))
                continue
            params, losses = {}, None
            for rank in range(stages * replicas):
                part = torch.load(os.path.join(out, "rank_%d.pt" % rank))
                losses = part["losses"]
                for name, tensor in part["params"].items():
                    if name in params and not torch.equal(params[name], tensor):
                        failures.append("%s: replicas disagree on %s" % (what, name))
                    params[name] = tensor
        if any(abs(a - b) > 1e-5 * max(1.0, abs(b)) for a, b in zip(losses, ref_losses)):
            failures.append("%s: losses %s vs the plain module's %s" % (what, losses, ref_losses))
        if set(params) != set(ref_params):
            failures.append("%s: parameter names %s vs %s" % (what, sorted(set(params) ^ set(ref_params)), "the model's"))
            continue
        for name, tensor in ref_params.items():
            if not torch.allclose(params[name], tensor, rtol=1e-5, atol=1e-6):
                failures.append("%s: %s differs by %.3g" % (what, name, (params[name] - tensor).abs().max().item()))


# --- refusals: each model below breaks one rule --------------------------------------------

class Crossing(cm.ManualGPT):
    def forward(self, input_ids, targets):
        embedded = self.wte(input_ids)
        x = self.cutpoints[0](embedded)
        for i in range(1, cm.BLOCKS):
            x = self.cutpoints[i](x)
        x = x + embedded  # CROSSING: the embedding crosses every cut
        return torch.nn.functional.cross_entropy((x @ self.lm_head_weight.t()).reshape(-1, cm.VOCAB),
                                                 targets.reshape(-1))


class CalledTwice(cm.ManualGPT):
    def forward(self, input_ids, targets):
        x = self.wte(input_ids)
        for i in range(cm.BLOCKS):
            x = self.cutpoints[0](x)
        return torch.nn.functional.cross_entropy((x @ self.lm_head_weight.t()).reshape(-1, cm.VOCAB),
                                                 targets.reshape(-1))


class NeverCalled(cm.ManualGPT):
    def forward(self, input_ids, targets):
        x = self.wte(input_ids)
        for i in range(cm.BLOCKS - 1):
            x = self.cutpoints[i](x)
        return torch.nn.functional.cross_entropy((x @ self.lm_head_weight.t()).reshape(-1, cm.VOCAB),
                                                 targets.reshape(-1))


class WeightOnBothSides(cm.ManualGPT):
    def forward(self, input_ids, targets):
        x = self.wte(input_ids)
        for i in range(cm.BLOCKS):
            x = self.cutpoints[i](x)
        return torch.nn.functional.cross_entropy((x @ self.wte.weight.t()).reshape(-1, cm.VOCAB),
                                                 targets.reshape(-1))


class NoCutPoints(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x).sum()


def refusal(model, shared=cm.SHARED):
    launch = varuna.get_launch_args(["refusal"])
    try:
        varuna.Varuna(model, "0;", cm.get_batch, GLOBAL_BATCH, MICRO, launch_args=launch, shared_weights=shared)
    except varuna.ConfigError as error:
        return str(error)
    return None


def test_refusals_name_the_culprit():
    source = os.path.basename(__file__)
    cases = [
        ("crossing value", Crossing(), cm.SHARED, ["'wte'", "crosses CutPoint cutpoints[", source, "line"]),
        ("called twice", CalledTwice(), cm.SHARED, ["CutPoint cutpoints[0] is called twice"]),
        ("never called", NeverCalled(), cm.SHARED, ["CutPoint cutpoints[3] is never called"]),
        ("weight on both sides", WeightOnBothSides(), [], ["'wte.weight' is used on both sides of CutPoint",
                                                          "shared_weights"]),
        ("unknown shared weight", cm.build(), [("wte.weight", "lm_head.weight")],
         ["shared weight 'lm_head.weight' is not a parameter", "lm_head_weight"]),
        ("no CutPoint", NoCutPoints(), [], ["has no CutPoint", "varuna.CutPoint"]),
    ]
    for what, model, shared, expected in cases:
        message = refusal(model, shared)
        if message is None:
            failures.append("%s: accepted" % what)
            continue
        missing = [e for e in expected if e not in message]
        if missing:
            failures.append("%s: the message lacks %s: %s" % (what, missing, message))
    # The crossing's message points at the line that uses the value.
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if "# CROSSING" in text)
    message = refusal(Crossing()) or ""
    if "line %d" % line not in message:
        failures.append("crossing value: the message does not give line %d: %s" % (line, message))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        checks.run(globals())
