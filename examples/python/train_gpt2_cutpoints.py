#!/usr/bin/env python3
"""Trains (or, with --profile DIR, profiles) the GPT-2-style CutPoint model of
gpt2_cutpoints.py on Varuna's engine: the manual's form end to end, on the
character-level data of train_gpt.py (gpt.py's CharDataset).

    # profile on 2 processes, then let run_varuna choose the plan from it
    scripts/varuna_launch.py --nstages 2 --chunk_size 1 --batch_size 1 \\
        -- .venv/bin/python examples/python/train_gpt2_cutpoints.py --profile prof --micro_batch_sizes 1,2,4
    run_varuna --machine_list machines.txt --batch_size 16 --profile prof/profile.json \\
        -- .venv/bin/python examples/python/train_gpt2_cutpoints.py --steps 200
    # or with a plan of your own
    scripts/varuna_launch.py --nstages 2 --replicas 2 --chunk_size 4 --batch_size 16 \\
        -- .venv/bin/python examples/python/train_gpt2_cutpoints.py --steps 50 --meta

The model flags (--d_model --layers --heads --seq_len --dropout --data) must
be the same for profiling and training: the profile names the pieces and
their parameter counts, and the workers refuse a profile of another model.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402  (CharDataset: the same data as train_gpt.py)
import gpt2_cutpoints  # noqa: E402
import varuna  # noqa: E402


def sizes(text):
    return [int(s) for s in text.split(",") if s]


def parse(argv):
    p = argparse.ArgumentParser(prog="train_gpt2_cutpoints.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50, help="optimizer steps of the whole run")
    p.add_argument("--data", default="/usr/share/common-licenses", help="text file or directory of text files")
    p.add_argument("--optimizer", default="adamw", help="adamw, sgd, or any torch.optim class name (e.g. RMSprop)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm (<= 0: off)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--schedule", default="varuna",
                   help="varuna, 1f1b, gpipe, zb-h1, interleaved[:chunks] or zbv (docs/worker-api.md)")
    p.add_argument("--data_seed", type=int, default=7)
    p.add_argument("--log_every", type=int, default=1)
    p.add_argument("--init_loss_scale", type=float, default=65536, help="fp16 initial loss scale")
    p.add_argument("--loss_scale_growth_interval", type=int, default=1000,
                   help="fp16 clean steps before the scale grows")
    p.add_argument("--dump_dir", default="",
                   help="write per-step results (rank<r>_steps.jsonl) and the final parameters (rank<r>_params.pt) "
                        "here")
    p.add_argument("--checkpoint_dir", default="", help="global store (default: run_varuna's)")
    p.add_argument("--checkpoint_every", type=int, default=0)
    p.add_argument("--keep_checkpoints", type=int, default=-1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--peer_timeout_s", type=float, default=60)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--model_seed", type=int, default=1234)
    p.add_argument("--meta", action="store_true",
                   help="build the model on the meta device: each rank materialises only its own pieces and "
                        "initialises them with gpt2_cutpoints.init_fn (the same weights as without --meta)")
    # Profiling (varuna.Profiler): profile_gpt's flags, the manual's names second.
    p.add_argument("--profile", "--out_folder", metavar="DIR", default="",
                   help="profile the model into DIR/profile.json instead of training")
    p.add_argument("--micro_batch_sizes", "--batch_sizes", type=sizes, default=[1, 2, 4, 8],
                   help="--profile: micro-batch sizes, e.g. 1,2,4,8")
    p.add_argument("--pieces", "--pstages_to_profile", type=lambda t: [s for s in t.split(",") if s], default=None,
                   help="--profile: pieces to profile, by name or index (default: all)")
    p.add_argument("--add", "--add_to_existing", action="store_true",
                   help="--profile: add to the profile already in DIR (refused if the model changed)")
    p.add_argument("--reuse", "--from_cache", action="store_true",
                   help="--profile: skip what the existing profile already has (implies --add)")
    p.add_argument("--warmup", type=int, default=None, help="--profile: untimed runs first (default 2)")
    p.add_argument("--repetitions", type=int, default=None, help="--profile: timed runs per figure (default 8)")
    p.add_argument("--no_comm", action="store_true", help="--profile: skip the point-to-point and all-reduce figures")
    return p.parse_args(argv)


def make_optimizer(o, params):
    if o.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, weight_decay=0.0)
    if o.optimizer == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum)
    kind = {c.lower(): c for c in dir(torch.optim)}.get(o.optimizer.lower())
    if kind is None:
        raise varuna.ConfigError("train_gpt2_cutpoints.py: unknown optimizer '%s'" % o.optimizer)
    return getattr(torch.optim, kind)(params, lr=o.lr)


def print_profile(profile):
    print("%-8s %6s %12s %12s %12s %10s" % ("piece", "micro", "forward_ms", "backward_ms", "recompute_ms", "output_B"))
    for piece in profile["pieces"]:
        for size, f in sorted(piece["micro_batch"].items(), key=lambda kv: int(kv[0])):
            print("%-8s %6s %12.3f %12.3f %12.3f %10d" % (
                piece["name"], size, f["forward"]["median_s"] * 1e3, f["backward"]["median_s"] * 1e3,
                f["recompute"]["median_s"] * 1e3, f["output_bytes"]))
    print("optimizer %.3g s per parameter; %d point-to-point and %d all-reduce samples" % (
        profile["optimizer_s_per_param"], len(profile["p2p"]), len(profile["allreduce"])), flush=True)


def profile(o, launch, model, sample):
    """The manual's three steps, on every worker of the profiling job."""
    profiler = varuna.Profiler(model, sample, device=o.device, fp16=o.precision == "fp16", out_folder=o.profile,
                               pstages_to_profile=o.pieces, from_cache=o.reuse, add_to_existing=o.add,
                               precision=o.precision, shared_weights=gpt2_cutpoints.SHARED_WEIGHTS,
                               seed=o.model_seed, init_fn=gpt2_cutpoints.init_fn if o.meta else None,
                               warmup=o.warmup, repetitions=o.repetitions, profile_communication=not o.no_comm,
                               peer_timeout_s=o.peer_timeout_s, launch_args=launch)
    # The optimizer training uses (its type is what is timed); over the
    # model's parameters, as the manual has it (meta ones cost nothing).
    profiler.set_optimizer(make_optimizer(o, model.parameters()))
    result = profiler.profile_all(o.micro_batch_sizes)
    if launch.rank == 0:
        print_profile(result)
        print("wrote %s" % os.path.join(o.profile, "profile.json"), flush=True)


def main():
    varuna.install_checkpoint_signal_handler()  # first: run_varuna's SIGUSR1 is then never fatal
    launch = varuna.get_launch_args()
    o = parse(launch.user_args)
    torch.set_num_threads(o.threads)
    data = gpt.CharDataset.from_path(o.data)
    model = gpt2_cutpoints.build(data.vocab_size, o.d_model, o.heads, o.layers, o.seq_len, o.dropout,
                                 seed=o.model_seed, meta=o.meta)

    def sample(size, device):
        return {k: v.to(device) for k, v in data.samples(0, size, o.seq_len, o.data_seed).items()}

    if o.profile:
        profile(o, launch, model, sample)
        return
    store = o.checkpoint_dir or launch.global_store
    # The launcher's global batch (8 per replica when it gave none).
    global_batch = launch.batch_size if launch.batch_size > 0 else 8 * launch.replicas
    chunk = launch.chunk_size if launch.chunk_size > 0 else min(global_batch // launch.replicas, 4)

    model = varuna.Varuna(model, get_batch_fn=sample, batch_size=global_batch, chunk_size=chunk,
                          shared_weights=gpt2_cutpoints.SHARED_WEIGHTS, precision=o.precision, schedule=o.schedule,
                          device=o.device, seed=o.model_seed, peer_timeout_s=o.peer_timeout_s, launch_args=launch,
                          global_store=store or None, init_fn=gpt2_cutpoints.init_fn if o.meta else None,
                          keep_checkpoints=o.keep_checkpoints if o.keep_checkpoints >= 0 else None)
    model.set_optimizer(make_optimizer(o, model.parameters()), init_loss_scale=o.init_loss_scale,
                        loss_scale_growth_interval=o.loss_scale_growth_interval)
    if launch.resume_step >= 0:
        if not store:
            raise varuna.ConfigError("--resume_step needs --checkpoint_dir")
        loaded = model.load_latest_checkpoint(store, launch.resume_step)
        if loaded is None:
            raise varuna.Error("no checkpoint at or below step %d in '%s' could be loaded" % (launch.resume_step, store))
    reporter = launch.rank == 0
    log = None
    if o.dump_dir:
        os.makedirs(o.dump_dir, exist_ok=True)
        log = open(os.path.join(o.dump_dir, "rank%d_steps.jsonl" % launch.rank), "a" if launch.resume_step >= 0 else "w")
    if reporter:
        print("training %d steps on %d stages x %d replicas: global batch %d x %d characters, vocab %d" % (
            o.steps, model.num_stages, model.num_replicas, global_batch, o.seq_len, data.vocab_size), flush=True)
    for step in range(model.steps_done, o.steps):
        batch = data.replica_batch(step, global_batch, model.replica, model.num_replicas, o.seq_len, o.data_seed)
        start = time.monotonic()
        result = model.step(batch, o.clip if o.clip > 0 else None)
        seconds = time.monotonic() - start
        if log:
            log.write(json.dumps({"step": step, "loss": result.loss, "overflow": result.overflow,
                                  "grad_norm": result.grad_norm, "loss_scale": result.loss_scale,
                                  "time_s": seconds}) + "\n")
            log.flush()
        if result.checkpoint_requested and reporter:
            print("checkpoint requested: writing step %d on demand, then exiting" % (step + 1), flush=True)
        model.exit_if_checkpoint_requested(result)  # SIGUSR1 on any rank: checkpoint this step, exit 75
        if store and o.checkpoint_every > 0 and (step + 1) % o.checkpoint_every == 0 and step + 1 < o.steps:
            model.checkpoint(store, step + 1)
        if reporter and (step % o.log_every == 0 or step + 1 == o.steps):
            print("step %d loss %.6g grad_norm %.6g%s time %.3fs" % (
                step, result.loss, result.grad_norm, " overflow(skipped)" if result.overflow else "", seconds),
                flush=True)
    if store:
        model.checkpoint(store, o.steps)
        model.wait_for_checkpoints()
    held_out = data.replica_batch(o.steps, global_batch, model.replica, model.num_replicas, o.seq_len, o.data_seed)
    evaluation = model.evaluate(held_out)
    if reporter:
        print("eval loss %.6g" % evaluation, flush=True)
    if o.dump_dir:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
                   os.path.join(o.dump_dir, "rank%d_params.pt" % launch.rank))
    if reporter:
        print("done", flush=True)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - a worker ends with its error's exit code
        varuna.exit_after_failure(error)
