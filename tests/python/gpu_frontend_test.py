#!/usr/bin/env python3
"""The Python front end on CUDA (label gpu; exit 77, skipped, without a GPU):

  cutpoint on cuda   the manual-style CutPoint model (cutpoint_model.py) with
                     device="cuda" trains like the same nn.Module in plain
                     PyTorch on the same GPU, deterministic fp32: 1x1 over
                     NCCL, 2x1 with both stages sharing the GPU through Gloo
                     (losses and every parameter, rtol 1e-5)
  fp16 overflow      an infinite gradient injected on one rank of a 2x2 fp16
                     job sharing the GPU makes every rank skip that step
                     and halve the loss scale, and no other step

    gpu_frontend_test.py [name ...]
    gpu_frontend_test.py --worker --out DIR --comm_backend B   (one rank)
"""
import argparse
import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checks  # noqa: E402
import cutpoint_model as cm  # noqa: E402
import varuna  # noqa: E402

GLOBAL_BATCH, MICRO, STEPS = 8, 2, 3
failures = checks.failures


def deterministic():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def reference():
    model = cm.build().cuda()
    model.lm_head_weight = model.wte.weight  # one weight in the plain loop
    opt = cm.make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        loss = model(**{k: v.cuda() for k, v in cm.global_batch(step, GLOBAL_BATCH).items()})
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters(remove_duplicate=False)}


def worker():
    deterministic()
    launch = varuna.get_launch_args()
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--comm_backend", required=True)
    args = parser.parse_args(launch.user_args)
    try:
        model = varuna.Varuna(cm.build(), launch.stage_to_rank_map, cm.get_batch, GLOBAL_BATCH, launch.chunk_size,
                              launch_args=launch, shared_weights=cm.SHARED, peer_timeout_s=60, device="cuda",
                              comm_backend=args.comm_backend)
        model.set_optimizer(cm.make_optimizer(model.parameters()))
        share = GLOBAL_BATCH // model.num_replicas
        losses = []
        for step in range(STEPS):
            batch = cm.global_batch(step, GLOBAL_BATCH)
            losses.append(model.step({k: v[model.replica * share:(model.replica + 1) * share]
                                      for k, v in batch.items()}).loss)
        params = {n: p.detach().cpu() for n, p in model.named_parameters()}
        devices = sorted({str(p.device) for p in model.parameters()})
        torch.save({"losses": losses, "params": params, "devices": devices},
                   os.path.join(args.out, "rank_%d.pt" % launch.rank))
    except Exception as error:  # noqa: BLE001 - every failure ends the worker with its code
        varuna.exit_after_failure(error)


def test_cutpoint_model_on_cuda_equals_plain_pytorch():
    ref_losses, ref_params = reference()
    for stages, backend in [(1, "nccl"), (2, "gloo")]:
        what = "%dx1 over %s" % (stages, backend)
        with tempfile.TemporaryDirectory() as out:
            proc = checks.launch(os.path.abspath(__file__), stages, 1, MICRO, GLOBAL_BATCH,
                                 ["--worker", "--out", out, "--comm_backend", backend])
            if proc.returncode != 0:
                failures.append("%s failed (%d): %s" % (what, proc.returncode, checks.output_of(proc)))
                continue
            parts = [torch.load(os.path.join(out, "rank_%d.pt" % r)) for r in range(stages)]
        params = {}
        for part in parts:
            params.update(part["params"])
            if part["devices"] != ["cuda:0"]:
                failures.append("%s: parameters on %s, not cuda:0" % (what, part["devices"]))
        losses = parts[0]["losses"]
        if any(abs(a - b) > 1e-5 * max(1.0, abs(b)) for a, b in zip(losses, ref_losses)):
            failures.append("%s: losses %s vs plain PyTorch's %s" % (what, losses, ref_losses))
        if set(params) != set(ref_params):
            failures.append("%s: parameter names differ: %s" % (what, sorted(set(params) ^ set(ref_params))))
            continue
        for name, tensor in ref_params.items():
            if not torch.allclose(params[name], tensor, rtol=1e-5, atol=1e-6):
                failures.append("%s: %s differs by %.3g" % (what, name, (params[name] - tensor).abs().max().item()))


OVERFLOW_STEP, OVERFLOW_RANK, FP16_STEPS = 3, 2, 6


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    with tempfile.TemporaryDirectory() as out:
        proc = checks.launch(os.path.join(HERE, "frontend_faults_worker.py"), 2, 2, 4, 16,
                             ["--out", out, "--global_batch", 16, "--steps", FP16_STEPS, "--precision", "fp16",
                              "--init_loss_scale", 1024, "--overflow_at", OVERFLOW_STEP,
                              "--overflow_rank", OVERFLOW_RANK, "--device", "cuda", "--comm_backend", "gloo"])
        if proc.returncode != 0:
            raise AssertionError("the fp16 job failed (%d): %s" % (proc.returncode, checks.output_of(proc)))
        per_rank = []
        for rank in range(4):
            with open(os.path.join(out, "rank_%d.jsonl" % rank)) as f:
                per_rank.append([json.loads(line) for line in f])
    expected = [s == OVERFLOW_STEP for s in range(FP16_STEPS)]
    for rank, steps in enumerate(per_rank):
        flags = [s["overflow"] for s in steps]
        if flags != expected:
            failures.append("rank %d: overflow flags %s, expected %s" % (rank, flags, expected))
        scales = [s["loss_scale"] for s in steps]
        if scales[OVERFLOW_STEP + 1] != scales[OVERFLOW_STEP] / 2:
            failures.append("rank %d: the loss scale did not halve after the overflow: %s" % (rank, scales))
        if [s["loss"] for s in steps] != [s["loss"] for s in per_rank[0]]:
            failures.append("rank %d's losses differ from rank 0's" % rank)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    elif not torch.cuda.is_available():
        print("no CUDA device: gpu tests skipped")
        sys.exit(77)
    else:
        deterministic()
        checks.run(globals())
