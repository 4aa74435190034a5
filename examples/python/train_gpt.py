#!/usr/bin/env python3
"""The example GPT trained from Python on Varuna's engine: the same model,
data, options and output as the C++ build/examples/gpt/train_gpt, so either
resumes the other's checkpoints (docs/python.md).

    scripts/varuna_launch.py --nstages 2 --replicas 2 --chunk_size 4 --batch_size 16 \\
        -- .venv/bin/python examples/python/train_gpt.py --steps 50
    run_varuna --machine_list machines.txt --nstages 2 --chunk_size 4 --batch_size 16 \\
        -- .venv/bin/python examples/python/train_gpt.py --steps 200
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402
import varuna  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(prog="train_gpt.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50, help="optimizer steps of the whole run")
    p.add_argument("--data", default="/usr/share/common-licenses", help="text file or directory of text files")
    p.add_argument("--optimizer", default="adamw", help="adamw, sgd, or any torch.optim class name (e.g. RMSprop)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm (<= 0: off)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--schedule", default="varuna",
                   help="varuna, 1f1b, gpipe, zb-h1, interleaved[:chunks] or zbv (docs/worker-api.md)")
    p.add_argument("--nonfinite", default="skip", choices=["skip", "stop"],
                   help="fp32/bf16 step with non-finite gradients: skip it, or stop (optimizer queued first: faster on GPUs)")
    p.add_argument("--data_seed", type=int, default=7)
    p.add_argument("--log_every", type=int, default=1)
    p.add_argument("--init_loss_scale", type=float, default=65536, help="fp16 initial loss scale")
    p.add_argument("--loss_scale_growth_interval", type=int, default=1000,
                   help="fp16 clean steps before the scale grows")
    p.add_argument("--dump_dir", default="",
                   help="write per-step results (rank<r>_steps.jsonl) and the initial and final parameters "
                        "(rank<r>_initial.pt, rank<r>_params.pt) here, as the C++ example")
    p.add_argument("--trace_dir", default="",
                   help="each rank writes its steps' timeline here (rank<r>_trace.json; scripts/pipeline_trace.py)")
    p.add_argument("--checkpoint_dir", default="", help="global store (default: run_varuna's)")
    p.add_argument("--checkpoint_every", type=int, default=0)
    p.add_argument("--keep_checkpoints", type=int, default=-1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (this worker's GPU by its local rank)")
    p.add_argument("--comm_backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="auto: NCCL on CUDA, Gloo on the CPU; gloo also on CUDA (ranks may share a GPU)")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms (and CUBLAS_WORKSPACE_CONFIG): for equivalence runs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--peer_timeout_s", type=float, default=60)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--model_seed", type=int, default=1234)
    p.add_argument("--untied", action="store_true")
    p.add_argument("--batchnorm", action="store_true")
    return p.parse_args(argv)


def make_optimizer(o, params):
    if o.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, weight_decay=0.0)  # as the C++ example
    if o.optimizer == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum)
    kind = {c.lower(): c for c in dir(torch.optim)}.get(o.optimizer.lower())
    if kind is None:
        raise varuna.ConfigError("train_gpt.py: unknown optimizer '%s'" % o.optimizer)
    return getattr(torch.optim, kind)(params, lr=o.lr)


def main():
    varuna.install_checkpoint_signal_handler()  # first: run_varuna's SIGUSR1 is then never fatal
    launch = varuna.get_launch_args()
    o = parse(launch.user_args)
    torch.set_num_threads(o.threads)
    if o.deterministic:  # before any CUDA work: cuBLAS reads the variable once
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    store = o.checkpoint_dir or launch.global_store
    data = gpt.CharDataset.from_path(o.data)
    config = gpt.GptConfig(vocab_size=data.vocab_size, d_model=o.d_model, heads=o.heads, layers=o.layers,
                           seq_len=o.seq_len, dropout=o.dropout, seed=o.model_seed,
                           tie_embeddings=not o.untied, batch_norm=o.batchnorm)
    pieces, shared = gpt.gpt_pieces(config)
    # The launcher's global batch (8 per replica when it gave none).
    global_batch = launch.batch_size if launch.batch_size > 0 else 8 * launch.replicas
    chunk = launch.chunk_size if launch.chunk_size > 0 else min(global_batch // launch.replicas, 4)

    def sample(size, device):
        return {k: v.to(device) for k, v in data.samples(0, size, o.seq_len, o.data_seed).items()}

    model = varuna.Varuna(pieces, get_batch_fn=sample, batch_size=global_batch, chunk_size=chunk,
                          shared_weights=shared, precision=o.precision, schedule=o.schedule, device=o.device,
                          comm_backend=o.comm_backend, on_nonfinite=o.nonfinite,
                          seed=o.model_seed, peer_timeout_s=o.peer_timeout_s, launch_args=launch,
                          global_store=store or None, trace_dir=o.trace_dir or None,
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
        # What this rank starts from (after a resume: the loaded values), as the C++
        # example writes it: bench/pipeline checks both front ends start alike.
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
                   os.path.join(o.dump_dir, "rank%d_initial.pt" % launch.rank))
        log = open(os.path.join(o.dump_dir, "rank%d_steps.jsonl" % launch.rank), "a" if launch.resume_step >= 0 else "w")
    if reporter:
        print("training %d steps: global batch %d x %d characters, vocab %d, text of %d characters" % (
            o.steps, global_batch, o.seq_len, data.vocab_size, len(data.tokens)), flush=True)
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
