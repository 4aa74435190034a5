#!/usr/bin/env python3
"""Hugging Face transformers models (hf_models.py: GPT-2, Llama-style,
BERT-style, built from configs) in the manual's form: the model unchanged,
varuna.hf.cut_between_blocks(model), varuna.Varuna(model, ...):

  layouts          under (P,D) in (1,1) (2,1) (2,2) (4,1), with SGD: losses,
                   gradient norms and every parameter (each name of a tied
                   embedding too) equal the same model trained plainly in one
                   process (rtol 1e-5). Each model runs as 2x2 (pipeline and
                   replicas at once); GPT-2 also as 1x1 and 4x1, BERT as 4x1,
                   Llama as 2x1 and 4x1 in the meta test: each layout with
                   at least one model, each model with pipeline and replicas
                   together, in 27 worker processes instead of the 39 of every
                   model in every layout (each starts torch: 5 s of CPU)
  adamw            GPT-2 as 2x2 with AdamW, which turns rounding differences
                   in near-zero gradients into whole steps: within 3x of what
                   plain PyTorch shows against itself when only the order of
                   the gradient summation changes (measured here)
  meta             the Llama-style model built on the meta device, each rank
                   materialising and initialising (its own _init_weights) only
                   its pieces, equals the model initialised the same way whole
  the example      examples/python/train_hf.py, launched as its docstring
                   says (its workers forked from a launcher that preloaded
                   torch and transformers), trains each model (the loss
                   falls) and evaluates

    hf_test.py [name ...]
    hf_test.py --worker --out DIR --kind K [--optimizer O] [--meta]   (one rank)
"""
import argparse
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checks  # noqa: E402
import hf_models as hm  # noqa: E402
import varuna  # noqa: E402

GLOBAL_BATCH, MICRO, STEPS, SEED = 8, 2, 3, 11
PRELOAD = checks.PRELOAD + ",transformers.modeling_utils"  # the models' import, once per job
LAYOUTS = {"gpt2": [(1, 1), (2, 2), (4, 1)], "llama": [(2, 2)], "bert": [(2, 2), (4, 1)]}
failures = checks.failures


def worker():
    launch = varuna.get_launch_args()
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--kind", choices=hm.KINDS, required=True)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--meta", action="store_true")
    args = parser.parse_args(launch.user_args)
    try:
        model = varuna.hf.cut_between_blocks(hm.build(args.kind, meta=args.meta))

        def get_batch(size, device):
            return {k: v.to(device) for k, v in hm.global_batch(args.kind, 0, size).items()}
        runtime = varuna.Varuna(model, launch.stage_to_rank_map, get_batch, GLOBAL_BATCH, launch.chunk_size,
                                launch_args=launch, peer_timeout_s=60, seed=SEED,
                                init_fn=varuna.hf.init_fn(model) if args.meta else None)
        del model
        runtime.set_optimizer(hm.make_optimizer(args.optimizer, runtime.parameters()))
        share = GLOBAL_BATCH // runtime.num_replicas
        losses, norms = [], []
        for step in range(STEPS):
            batch = hm.global_batch(args.kind, step, GLOBAL_BATCH)
            result = runtime.step({k: v[runtime.replica * share:(runtime.replica + 1) * share]
                                   for k, v in batch.items()})
            losses.append(result.loss)
            norms.append(result.grad_norm)
        torch.save({"losses": losses, "norms": norms,
                    "params": {n: p.detach().clone() for n, p in runtime.named_parameters()},
                    "buffers": [n for n, _ in runtime.named_buffers()]},
                   os.path.join(args.out, "rank_%d.pt" % launch.rank))
    except Exception as error:  # noqa: BLE001 - every failure ends the worker with its code
        varuna.exit_after_failure(error)


def run_layout(kind, stages, replicas, *worker_args):
    """(losses, norms, params by name, buffer names) of one job, or None
    after recording its failure."""
    what = "%s %dx%d%s" % (kind, stages, replicas, "".join(" " + str(a) for a in worker_args))
    with tempfile.TemporaryDirectory() as out:
        proc = checks.launch(os.path.abspath(__file__), stages, replicas, MICRO, GLOBAL_BATCH,
                             ["--worker", "--out", out, "--kind", kind] + list(worker_args), preload=PRELOAD)
        if proc.returncode != 0:
            failures.append("%s failed (%d): %s" % (what, proc.returncode, proc.stderr[-3000:]))
            return None
        parts = [torch.load(os.path.join(out, "rank_%d.pt" % r)) for r in range(stages * replicas)]
    params, buffers = {}, []
    for part in parts:
        for name, tensor in part["params"].items():
            if name in params and not torch.equal(params[name], tensor):
                failures.append("%s: replicas disagree on %s" % (what, name))
            params[name] = tensor
        buffers += part["buffers"]
    return parts[0]["losses"], parts[0]["norms"], params, buffers


def compare(what, ours, plain, rtol, atol=1e-6):
    losses, norms, params, buffers = ours
    ref_losses, ref_norms, ref_params = plain
    for label, a, b in (("losses", losses, ref_losses), ("gradient norms", norms, ref_norms)):
        if len(a) != len(b) or any(abs(x - y) > rtol * max(1.0, abs(y)) for x, y in zip(a, b)):
            failures.append("%s: %s %s vs plain %s" % (what, label, a, b))
    # Every name is the model's, and every tensor of the model is there (a
    # tensor held under two names used in one piece: under one of them).
    unknown = sorted(set(params) - set(ref_params))
    covered = {id(ref_params[n]) for n in params if n in ref_params}
    missing = sorted(n for n, t in ref_params.items() if id(t) not in covered)
    if unknown or missing:
        failures.append("%s: names not the model's %s; tensors missing %s" % (what, unknown, missing))
        return
    worst = max(((t - ref_params[n]).abs().max().item() / (ref_params[n].abs().max().item() + atol), n)
                for n, t in params.items())
    bad = [n for n, t in params.items() if not torch.allclose(t, ref_params[n], rtol=rtol, atol=atol)]
    if bad:
        failures.append("%s: %d parameters differ, e.g. %s (worst relative %.3g at %s)" % (what, len(bad), bad[0],
                                                                                       worst[0], worst[1]))
    unnamed = [n for n in buffers if n.startswith("piece")]
    if unnamed:
        failures.append("%s: named_buffers() gives runtime names: %s" % (what, unnamed[:3]))


def plain(kind, optimizer="sgd", **kwargs):
    return hm.plain_run(hm.build(kind), kind, STEPS, GLOBAL_BATCH, optimizer, **kwargs)


def test_gpt2_layouts():
    check_layouts("gpt2")


def test_llama_layouts():
    check_layouts("llama")


def test_bert_layouts():
    check_layouts("bert")


def check_layouts(kind):
    reference = plain(kind)
    for stages, replicas in LAYOUTS[kind]:
        ours = run_layout(kind, stages, replicas)
        if ours is not None:
            compare("%s %dx%d" % (kind, stages, replicas), ours, reference, rtol=1e-5)


def test_adamw_within_the_floor_of_summation_order():
    full = plain("gpt2", "adamw")
    reordered = plain("gpt2", "adamw", micro=MICRO, reverse=True)
    floor = max((full[2][n] - reordered[2][n]).abs().max().item() for n in full[2])
    ours = run_layout("gpt2", 2, 2, "--optimizer", "adamw")
    if ours is None:
        return
    worst = max((ours[2][n] - t).abs().max().item() for n, t in full[2].items())
    print("adamw: plain against itself (summation order) %.3g, ours against plain %.3g" % (floor, worst),
          flush=True)
    if worst > 3 * max(floor, 1e-7):
        failures.append("adamw: ours differs from plain by %.3g, over 3x the floor %.3g" % (worst, floor))


def test_meta_built_llama_equals_the_initialised_model():
    model = hm.build("llama")
    with torch.no_grad():
        varuna.initialize(model, varuna.hf.init_fn(model), SEED)
    reference = hm.plain_run(model, "llama", STEPS, GLOBAL_BATCH, "sgd")
    for stages, replicas in [(2, 1), (4, 1)]:
        ours = run_layout("llama", stages, replicas, "--meta")
        if ours is not None:
            compare("llama on meta %dx%d" % (stages, replicas), ours, reference, rtol=1e-5)


def test_the_example_trains_every_model():
    example = os.path.join(checks.SOURCE, "examples", "python", "train_hf.py")
    for kind in hm.KINDS:
        proc = checks.launch(example, 2, 1, 4, 16, ["--model", kind, "--steps", "25"], preload=PRELOAD)
        lines = [line.split() for line in proc.stdout.splitlines() if line.startswith(("step ", "eval loss"))]
        if proc.returncode != 0 or not lines or lines[-1][:2] != ["eval", "loss"]:
            failures.append("train_hf.py --model %s failed (%d): %s" % (kind, proc.returncode, proc.stderr[-2000:]))
            continue
        losses = [float(line[3]) for line in lines if line[0] == "step"]
        if not losses[-1] < losses[0] - 0.5:
            failures.append("train_hf.py --model %s: the loss did not fall: %s" % (kind, losses))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        checks.run(globals())
