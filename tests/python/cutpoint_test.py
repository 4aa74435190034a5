#!/usr/bin/env python3
"""The manual's CutPoint form (varuna.CutPoint inside one nn.Module, split by
the package; cutpoint_model.py):

  equivalence   the manual-style GPT under (P,D) in (1,1) (2,1) (2,2) (4,1)
                trains like the same nn.Module in one plain process, with
                the tied pair truly one weight there (losses and every
                parameter, under the model's own names, rtol 1e-5)
  meta          the same, the model built on the meta device and each
                rank's pieces initialised by init_fn, against the plain
                module given the same weights by varuna.initialize
  memory        a rank of a 4-stage job of a 256 MB model built on meta
                owns under 0.3 of it and grows, building its stage, by
                less than 2.25x what it owns (its parameters and their
                gradient buckets; the runtime's own growth, measured with
                the small model, taken off)
  quiet end     ranks still busy after rank 0 (the store's host) finished
                end without store errors: rank 0 waits for them; but a
                rank 0 ending on an uncaught exception leaves at once
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
import resource
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checks  # noqa: E402
import cutpoint_model as cm  # noqa: E402
import varuna  # noqa: E402

GLOBAL_BATCH, MICRO, STEPS = 8, 2, 3
BIG_WIDTH, BIG_BLOCKS = 1024, 8  # 256 MB of parameters
failures = checks.failures


def reference(model):
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


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker():
    launch = varuna.get_launch_args()
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--meta", action="store_true", help="build on the meta device, init_fn")
    parser.add_argument("--big", action="store_true", help="a model of BIG_WIDTH x BIG_BLOCKS; memory only")
    parser.add_argument("--linger_s", type=float, default=0, help="ranks but 0 stay this long after training")
    parser.add_argument("--rank0_raises", action="store_true", help="rank 0 ends on an uncaught exception")
    args = parser.parse_args(launch.user_args)
    try:
        if args.big:
            built = cm.build_on_meta(BIG_WIDTH, BIG_BLOCKS)
        else:
            built = cm.build_on_meta() if args.meta else cm.build()
        # After the build: a model on meta holds no data, but torch's first
        # meta initialiser imports its Python meta kernels (~150 MB, once).
        baseline = peak_rss_bytes()
        model = varuna.Varuna(built, launch.stage_to_rank_map, cm.get_batch, GLOBAL_BATCH, launch.chunk_size,
                              launch_args=launch, shared_weights=cm.SHARED, peer_timeout_s=60,
                              init_fn=cm.init_fn, seed=cm.INIT_SEED)
        del built
        constructed = peak_rss_bytes()
        model.set_optimizer(torch.optim.SGD(model.parameters(), lr=0.01) if args.big
                            else cm.make_optimizer(model.parameters()))
        share = GLOBAL_BATCH // model.num_replicas
        losses = []
        for step in range(1 if args.big else STEPS):
            if args.rank0_raises and step == 1 and launch.rank == 0:
                break
            batch = cm.global_batch(step, GLOBAL_BATCH)
            losses.append(model.step({k: v[model.replica * share:(model.replica + 1) * share]
                                      for k, v in batch.items()}).loss)
        os.makedirs(args.out, exist_ok=True)
        owned = sum(p.numel() * p.element_size() for p in model.parameters())
        params = {} if args.big else {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.save({"losses": losses, "params": params, "owned_bytes": owned,
                    "rss": {"baseline": baseline, "constructed": constructed, "stepped": peak_rss_bytes()}},
                   os.path.join(args.out, "rank_%d.pt" % launch.rank))
        if launch.rank != 0:
            time.sleep(args.linger_s)  # the scenario: still busy after training, runtime open
    except Exception as error:  # noqa: BLE001 - every failure ends the worker with its code
        varuna.exit_after_failure(error)
    if args.rank0_raises and launch.rank == 0:
        raise RuntimeError("a bug in the user's program, not caught")  # the others wait in step 1


def run_job(out, stages, replicas, *worker_args):
    return checks.launch(os.path.abspath(__file__), stages, replicas, MICRO, GLOBAL_BATCH,
                         ["--worker", "--out", out] + list(worker_args))


def test_equivalence_with_the_plain_module():
    check_layouts(reference(cm.build()))


def test_meta_build_equals_the_initialised_module():
    # Built on the meta device, each rank materialises and initialises only
    # its pieces; the plain module gets the same weights from initialize().
    check_layouts(reference(cm.build_initialised()), "--meta")


def memory_job(stages, *worker_args):
    with tempfile.TemporaryDirectory() as out:
        proc = run_job(out, stages, 1, *worker_args)
        if proc.returncode != 0:
            raise AssertionError("%s failed (%d): %s" % (worker_args, proc.returncode, proc.stderr[-2500:]))
        return [torch.load(os.path.join(out, "rank_%d.pt" % rank)) for rank in range(stages)]


def test_memory_of_a_meta_built_rank():
    # Each rank of a 4-stage job holds about a quarter of the model. The
    # runtime's own growth (process groups, threads, the sample forward) is
    # measured with the small model and taken off.
    stages = 4
    model_bytes = sum(p.numel() * 4 for p in cm.build_on_meta(BIG_WIDTH, BIG_BLOCKS).parameters())
    small, big = memory_job(stages, "--meta"), memory_job(stages, "--big")
    for rank, (base, part) in enumerate(zip(small, big)):
        overhead = base["rss"]["constructed"] - base["rss"]["baseline"]
        grown = part["rss"]["constructed"] - part["rss"]["baseline"]
        print("rank %d: model %.0f MB, owns %.0f MB; peak RSS +%.0f MB building its stage (the runtime alone: "
              "+%.0f MB), +%.0f MB after a step" % (
                  rank, model_bytes / 2**20, part["owned_bytes"] / 2**20, grown / 2**20, overhead / 2**20,
                  (part["rss"]["stepped"] - part["rss"]["baseline"]) / 2**20), flush=True)
        # Its parameters and their gradient buckets (allocated when the
        # runtime is built), and nothing of the other stages: a rank that
        # had materialised the whole model would be over 4x its share here.
        if grown - overhead >= 2.25 * part["owned_bytes"]:
            failures.append("rank %d grew by %.0f MB (%.0f MB over the runtime's own) building a stage of %.0f MB "
                            "(bound: 2.25x, parameters and gradients)" % (
                                rank, grown / 2**20, (grown - overhead) / 2**20, part["owned_bytes"] / 2**20))
        if part["owned_bytes"] >= 0.3 * model_bytes:
            failures.append("rank %d owns %.0f MB of a %.0f MB model" % (rank, part["owned_bytes"] / 2**20,
                                                                         model_bytes / 2**20))


def check_layouts(ref, *worker_args):
    ref_losses, ref_params = ref
    for stages, replicas in [(1, 1), (2, 1), (2, 2), (4, 1)]:
        what = "%dx%d%s" % (stages, replicas, "".join(" " + a for a in worker_args))
        with tempfile.TemporaryDirectory() as out:
            proc = run_job(out, stages, replicas, *worker_args)
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


def test_a_job_ends_quietly():
    # Rank 0 hosts the rendezvous store and finishes first; the others are
    # still busy with the runtime open. Rank 0 waits for them on its way out,
    # so nobody's heartbeat hits a closed store (libtorch prints a stack
    # trace for each one that does).
    with tempfile.TemporaryDirectory() as out:
        proc = run_job(out, 2, 1, "--linger_s", "3")
    if proc.returncode != 0:
        raise AssertionError("the job failed (%d): %s" % (proc.returncode, proc.stderr[-2500:]))
    noise = [line for line in (proc.stdout + proc.stderr).splitlines()
             if "recvValue failed" in line or "sendBytes failed" in line or "Exception raised" in line]
    if noise:
        failures.append("the job's end printed store errors: %s" % noise[:3])


def test_a_failing_rank_0_does_not_hold_the_job():
    # Rank 0 ends on an uncaught exception while the others wait for it in a
    # step: it must leave at once (not wait for them, as a clean end does),
    # so they see it gone well before their 60 s peer timeout.
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as out:
        proc = run_job(out, 2, 1, "--rank0_raises")
    elapsed = time.monotonic() - start
    if proc.returncode == 0:
        failures.append("the job succeeded although rank 0 raised")
    if "a bug in the user's program" not in proc.stderr:
        failures.append("rank 0's exception is not in the output: %s" % proc.stderr[-1500:])
    if elapsed > 45:
        failures.append("the job took %.0f s to end after rank 0 failed (rank 0 waited for its peers?)" % elapsed)


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


class ConstantAcrossCuts(cm.ManualGPT):
    """Accepted: a constant made from nothing, used on both sides of cuts."""

    def forward(self, input_ids, targets):
        scale = torch.full((1,), 0.5)
        x = self.wte(input_ids) * scale
        for i in range(cm.BLOCKS):
            x = self.cutpoints[i](x) * scale
        return torch.nn.functional.cross_entropy((x @ self.lm_head_weight.t()).reshape(-1, cm.VOCAB),
                                                 targets.reshape(-1))


class InPlaceOnInput(cm.ManualGPT):
    def forward(self, input_ids, targets):
        targets.masked_fill_(targets == 0, -100)  # the usual label masking, in place
        x = self.wte(input_ids)
        for i in range(cm.BLOCKS):
            x = self.cutpoints[i](x)
        return torch.nn.functional.cross_entropy((x @ self.lm_head_weight.t()).reshape(-1, cm.VOCAB),
                                                 targets.reshape(-1), ignore_index=-100)


class RandomAcrossCuts(cm.ManualGPT):
    def forward(self, input_ids, targets):
        keep = torch.rand(input_ids.shape) > 0.5  # drawn once: may not be drawn again in another piece
        x = self.wte(input_ids)
        for i in range(cm.BLOCKS):
            x = self.cutpoints[i](x)
        return torch.nn.functional.cross_entropy((x @ self.lm_head_weight.t()).reshape(-1, cm.VOCAB),
                                                 targets.masked_fill(keep, 0).reshape(-1))


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
        ("in place on an input", InPlaceOnInput(), cm.SHARED, ["in-place operation 'masked_fill_' changes 'targets'",
                                                               "out-of-place"]),
        ("random across cuts", RandomAcrossCuts(), cm.SHARED, ["'gt'", "crosses CutPoint"]),
    ]
    for what, model, shared, expected in cases:
        message = refusal(model, shared)
        if message is None:
            failures.append("%s: accepted" % what)
            continue
        missing = [e for e in expected if e not in message]
        if missing:
            failures.append("%s: the message lacks %s: %s" % (what, missing, message))
    try:
        varuna.cutpoint.split_at_cutpoints(ConstantAcrossCuts())
    except varuna.ConfigError as error:
        failures.append("a constant used across cuts was refused: %s" % error)
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
