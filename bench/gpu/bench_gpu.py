#!/usr/bin/env python3
"""The runtime on a GPU at a real size, beside a plain loop (docs/benchmarks.md,
"On a GPU"). Figures, not assertions; every row says which device gave it.

  overhead        the example GPT (>= 300M parameters, bf16, 1 stage x 1
                  replica, untied) under train_gpt against plain_gpt_loop,
                  the same model, data and AdamW in a plain libtorch loop:
                  overhead_vs_plain_loop = our tokens/s over the loop's
                  (target >= 0.97) with --nonfinite stop (the optimizer
                  queued before the step's exchange is read, as the loop
                  queues it before reading its loss); ..._skip: the default
                  --nonfinite skip (the exchange read first); mfu = model FLOPs per second over the
                  device's dense bf16 peak (PaLM's count: 6N + 12 L d T per
                  token, attention included)
  python          examples/python/train_gpt.py, the same model and plan:
                  python_step_over_cpp (target <= 1.05)
  start           worker start to the end of its first step, minus that
                  step (CUDA context, process group, model build):
                  worker_start_to_first_step_s
  split           the zero-bubble schedules' backward split (issue P14):
                  profile_gpt times one block and the head at micro-batch
                  sizes 2 and the bench's, whole backward against its input
                  half B and weight half W run on their own;
                  split_over_backward = (B + W) / backward over those pieces
                  (1.0: the split costs nothing; on the 2-core CPU VM it is
                  1.14-1.16, docs/benchmarks.md), split_kept_mib: what B keeps
                  for W per micro-batch

    bench_gpu.py --build BUILD [--python PY] [--out_dir DIR] [--steps N] [--smoke]

--smoke: a tiny model on the CPU (or the GPU when there is one), seconds: the
script still runs (CI's bench_gpu_smoke). The last stdout line is one JSON
object of every figure.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(os.path.dirname(HERE))

# Dense bf16 tensor-core peaks (FLOP/s) of the devices this runs on, by a
# substring of their name (NVIDIA's datasheets, SXM parts, no sparsity).
BF16_PEAKS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


def log(*parts):
    print("[bench_gpu]", *parts, file=sys.stderr, flush=True)


def device_info(python):
    code = ("import json, torch; c = torch.cuda.is_available(); "
            "print(json.dumps({'cuda': c, 'name': torch.cuda.get_device_name(0) if c else 'cpu', "
            "'torch': torch.__version__, 'cuda_version': torch.version.cuda}))")
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def model_args(size):
    return ["--d_model", str(size["d_model"]), "--layers", str(size["layers"]), "--heads", str(size["heads"]),
            "--seq_len", str(size["seq_len"])]


def run_plain_loop(build, size, device, steps, warmup, out_dir):
    argv = [os.path.join(build, "bench", "plain_gpt_loop"), "--device", device, "--precision", size["precision"],
            "--batch", str(size["batch"]), "--steps", str(steps), "--warmup", str(warmup)] + model_args(size)
    with open(os.path.join(out_dir, "plain_loop.log"), "w") as err:
        out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


STEP_LINE = re.compile(r"^step (\d+) loss .* time ([0-9.eE+-]+)s")


def run_ours(build, trainer, python, size, device, steps, warmup, out_dir, name, nonfinite="stop"):
    """One 1x1 job of a trainer ("cpp" or "python") through varuna_launch.py,
    printing every step's time (no dump: at this size the parameters alone
    are over a GB); the median step time after warmup, and the start-up: from
    the launch to the first step's line, minus that step."""
    program = ([os.path.join(build, "examples", "gpt", "train_gpt")] if trainer == "cpp"
               else [python, os.path.join(SOURCE, "examples", "python", "train_gpt.py")])
    argv = [python, os.path.join(SOURCE, "scripts", "varuna_launch.py"), "--nstages", "1", "--replicas", "1",
            "--chunk_size", str(size["batch"]), "--batch_size", str(size["batch"]), "--"] + program + [
        "--device", device, "--precision", size["precision"], "--untied", "--optimizer", "adamw", "--lr", "3e-4",
        "--clip", "0", "--steps", str(warmup + steps), "--log_every", "1", "--nonfinite", nonfinite] + model_args(size)
    log_path = os.path.join(out_dir, name + ".log")
    start = time.monotonic()
    first_line_at = None
    with open(log_path, "w") as logf:
        env = dict(os.environ, PYTHONPATH=os.path.join(build, "python"))
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            if first_line_at is None and _step_times(log_path):
                first_line_at = time.monotonic()
            time.sleep(0.01)
    if proc.returncode != 0:
        raise RuntimeError("%s failed (exit %d): see %s" % (name, proc.returncode, log_path))
    records = _step_times(log_path)
    times = sorted(t for _, t in records[warmup:])
    median = times[len(times) // 2]
    first_step = records[0][1]
    startup = (first_line_at - start - first_step) if first_line_at else None
    return {"step_s_median": median, "tokens_per_s": size["batch"] * size["seq_len"] / median,
            "start_to_first_step_s": startup, "first_step_s": first_step}


def _step_times(log_path):
    """[(step, seconds)] of the trainer's step lines so far."""
    with open(log_path, errors="replace") as f:
        return [(int(m.group(1)), float(m.group(2))) for m in map(STEP_LINE.match, f) if m]


def run_split_profile(build, size, device, out_dir, micro_sizes):
    """profile_gpt on one block and the head (the pieces zb-h1 and zbv split;
    the first piece runs its whole backward in W): per piece and micro-batch
    size, the backward and its B and W halves in ms, and their ratio."""
    folder = os.path.join(out_dir, "split_profile")
    argv = [os.path.join(build, "examples", "gpt", "profile_gpt"), "--profile_dir", folder, "--device", device,
            "--precision", size["precision"], "--untied", "--no_comm", "--pieces", "block0,head",
            "--micro_batch_sizes", ",".join(str(m) for m in micro_sizes), "--warmup", "3",
            "--repetitions", "10"] + model_args(size)
    with open(os.path.join(out_dir, "split_profile.log"), "w") as logf:
        subprocess.run(argv, stdout=logf, stderr=subprocess.STDOUT, check=True)
    with open(os.path.join(folder, "profile.json")) as f:
        profile = json.load(f)
    rows, whole, split = [], 0.0, 0.0
    for piece in profile["pieces"]:
        for micro, at in sorted(piece.get("micro_batch", {}).items(), key=lambda kv: int(kv[0])):
            if "backward_input" not in at:
                continue
            b, bi, bw = (at[k]["median_s"] * 1e3 for k in ("backward", "backward_input", "backward_weight"))
            rows.append({"piece": piece["name"], "micro": int(micro), "backward_ms": b, "b_ms": bi, "w_ms": bw,
                         "split_over_backward": (bi + bw) / b, "kept_mib": at.get("split_kept_bytes", 0) / 2**20})
            whole, split = whole + b, split + bi + bw
    if not rows:
        raise RuntimeError("profile_gpt measured no split backward: see %s" % folder)
    return {"rows": rows, "split_over_backward": split / whole}


def flops_per_token(params, size):
    return 6 * params + 12 * size["layers"] * size["d_model"] * size["seq_len"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", required=True, help="the build folder (train_gpt, plain_gpt_loop, python/)")
    parser.add_argument("--python", default=sys.executable, help="the Python with torch and this build's package")
    parser.add_argument("--out_dir", default="", help="logs and step records (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per side")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, seconds")
    args = parser.parse_args()
    build = os.path.abspath(args.build)
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="bench_gpu.")
    os.makedirs(out_dir, exist_ok=True)
    info = device_info(args.python)
    device = "cuda" if info["cuda"] else "cpu"
    if args.smoke:
        size = {"d_model": 32, "layers": 2, "heads": 2, "seq_len": 16, "batch": 4, "precision": "bf16"}
        steps, warmup = 4, 1
    elif not info["cuda"]:
        sys.exit("bench_gpu.py: no CUDA device here; run it on a GPU node (scripts/gpu_check.sh run), or --smoke")
    else:
        # 24 x 12 x 1024^2 = 302M parameters in the blocks.
        size = {"d_model": 1024, "layers": 24, "heads": 16, "seq_len": 1024, "batch": 8, "precision": "bf16"}
        steps, warmup = args.steps, 5
    log("device", info["name"], "torch", info["torch"], "size", size)
    plain = run_plain_loop(build, size, device, steps, warmup, out_dir)
    log("plain loop:", plain)
    cpp = run_ours(build, "cpp", args.python, size, device, steps, warmup, out_dir, "train_gpt")
    log("train_gpt --nonfinite stop:", cpp)
    cpp_skip = run_ours(build, "cpp", args.python, size, device, steps, warmup, out_dir, "train_gpt_skip", "skip")
    log("train_gpt --nonfinite skip:", cpp_skip)
    result = {"device": info["name"], "torch": info["torch"], "cuda": info["cuda_version"], "size": size,
              "params": plain["params"], "plain_loop_tokens_per_s": plain["tokens_per_s"],
              "tokens_per_s": cpp["tokens_per_s"],
              "overhead_vs_plain_loop": cpp["tokens_per_s"] / plain["tokens_per_s"],
              "tokens_per_s_skip": cpp_skip["tokens_per_s"],
              "overhead_vs_plain_loop_skip": cpp_skip["tokens_per_s"] / plain["tokens_per_s"],
              "worker_start_to_first_step_s": cpp["start_to_first_step_s"]}
    peak = next((v for k, v in BF16_PEAKS.items() if k in info["name"]), None)
    result["bf16_peak_flops"] = peak
    result["mfu"] = (flops_per_token(plain["params"], size) * cpp["tokens_per_s"] / peak) if peak else None
    try:
        split = run_split_profile(build, size, device, out_dir, sorted({2, size["batch"]}))
        log("split backward (B + W over the whole):", split)
        result["split_over_backward"] = split["split_over_backward"]
        result["split_rows"] = split["rows"]
    except (RuntimeError, subprocess.CalledProcessError, OSError, KeyError, ValueError,
            ZeroDivisionError) as error:  # the other rows still count
        log("split profile failed:", error)
        result["split_error"] = str(error)
    result["python_step_over_cpp"] = None
    if os.path.isdir(os.path.join(build, "python", "varuna")):
        try:
            py = run_ours(build, "python", args.python, size, device, steps, warmup, out_dir, "train_gpt_py")
        except RuntimeError as error:  # the C++ rows above still count: printed, then the failure
            result["python_error"] = str(error)
            print(json.dumps(result), flush=True)
            raise
        log("train_gpt.py:", py)
        result["python_tokens_per_s"] = py["tokens_per_s"]
        result["python_step_over_cpp"] = py["step_s_median"] / cpp["step_s_median"]
    else:
        log("no Python package in this build: python row skipped")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
