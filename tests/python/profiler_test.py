#!/usr/bin/env python3
"""varuna.Profiler (the C++ Profiler driven from Python) on the manual-style
GPT of cutpoint_model.py, in jobs of 2 real processes (varuna_launch.py):

  two_ranks        profile.json has the model's pieces (names and parameter
                   counts as split_at_cutpoints makes them, in model order),
                   every (piece, size) asked for with plausible figures
                   (output bytes = size x seq x width x 4), the AdamW state
                   size, communication samples; rank 0's return value is the
                   file, rank 1's None; the C++ reader accepts it with this
                   model's fingerprint and run_varuna --dry_run plans from it
  pieces_and_add   pstages_to_profile limits the pieces (by index and by
                   name); add_to_existing adds pieces and sizes and keeps the
                   old figures (a meta-built model, same fingerprint);
                   from_cache measures only what is missing; a changed model
                   with add_to_existing is refused on every rank (exit 2) and
                   the file is left as it was
  other_forms      (in this process, one rank) a Sequential of pieces and a
                   list of (name, factory) profile under their own names; the
                   optimizer's type decides what is timed (SGD: 4 bytes per
                   parameter, AdamW: 8; RMSprop as sgd, NAdam as adam); an
                   unknown piece is a ConfigError naming the pieces

    profiler_test.py [name ...]
    profiler_test.py --worker --out DIR [...]   (one rank; run by the test)
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.environ.get("VARUNA_SOURCE_DIR", os.path.dirname(os.path.dirname(HERE)))
BUILD = os.environ.get("VARUNA_BUILD_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, HERE)
import checks  # noqa: E402
import cutpoint_model as cm  # noqa: E402
import varuna  # noqa: E402
from varuna.cutpoint import split_at_cutpoints  # noqa: E402

failures = checks.failures
NAMES = ["piece%d" % k for k in range(cm.BLOCKS + 1)]


def worker():
    launch = varuna.get_launch_args()
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes", default="1,2,4")
    parser.add_argument("--pieces", default=None)
    parser.add_argument("--add", action="store_true")
    parser.add_argument("--reuse", action="store_true")
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--width", type=int, default=cm.WIDTH)
    parser.add_argument("--no_comm", action="store_true")
    args = parser.parse_args(launch.user_args)
    try:
        if args.meta:
            model = cm.build_on_meta(args.width)
        else:
            torch.manual_seed(11)
            model = cm.ManualGPT(args.width)
        pieces = None
        if args.pieces:
            pieces = [int(p) if p.isdigit() else p for p in args.pieces.split(",")]
        profiler = varuna.Profiler(model, cm.get_batch, out_folder=args.out, pstages_to_profile=pieces,
                                   from_cache=args.reuse, add_to_existing=args.add, shared_weights=cm.SHARED,
                                   init_fn=cm.init_fn if args.meta else None, seed=cm.INIT_SEED, warmup=1,
                                   repetitions=3, profile_communication=not args.no_comm, comm_repetitions=5,
                                   peer_timeout_s=60, launch_args=launch)
        profiler.set_optimizer(cm.make_optimizer(model.parameters()))
        result = profiler.profile_all([int(s) for s in args.sizes.split(",")])
        with open(os.path.join(args.out, "returned_%d.json" % launch.rank), "w") as f:
            json.dump({"result": result, "fingerprint": profiler.model_fingerprint() if launch.rank == 0 else None}, f)
    except Exception as error:  # noqa: BLE001 - every failure ends the worker with its code
        varuna.exit_after_failure(error)


def run_job(out, *worker_args):
    os.makedirs(out, exist_ok=True)
    return checks.launch(os.path.abspath(__file__), 2, 1, 1, 1, ["--worker", "--out", out] + list(worker_args))


def must_run(out, *worker_args):
    proc = run_job(out, *worker_args)
    if proc.returncode != 0:
        raise AssertionError("profiling %s failed (%d): %s" % (worker_args, proc.returncode, proc.stderr[-3000:]))
    return proc


def load(out):
    with open(os.path.join(out, "profile.json")) as f:
        return json.load(f)


def returned(out, rank):
    with open(os.path.join(out, "returned_%d.json" % rank)) as f:
        return json.load(f)


def counts():
    """The pieces' parameter counts as Varuna splits the model."""
    torch.manual_seed(11)
    pieces, _, _ = split_at_cutpoints(cm.ManualGPT())
    return {name: count for name, _, count in pieces}


def figures(profile):
    """{(piece, size): figures at that size}."""
    return {(p["name"], int(size)): f for p in profile["pieces"] for size, f in p["micro_batch"].items()}


def test_two_ranks_write_the_profile_the_cpp_side_reads():
    with tempfile.TemporaryDirectory() as out:
        must_run(out, "--sizes", "1,2,4")
        profile = load(out)
        expected = counts()
        if [p["name"] for p in profile["pieces"]] != NAMES:
            failures.append("pieces %s, expected %s" % ([p["name"] for p in profile["pieces"]], NAMES))
        for p in profile["pieces"]:
            if p["param_count"] != expected.get(p["name"]) or p["param_bytes"] != 4 * p["param_count"]:
                failures.append("%s: %d parameters (%d bytes), the model's piece has %s"
                                % (p["name"], p["param_count"], p["param_bytes"], expected.get(p["name"])))
        got = figures(profile)
        for name in NAMES:
            for size in (1, 2, 4):
                f = got.get((name, size))
                if f is None:
                    failures.append("(%s, %d) is missing" % (name, size))
                    continue
                for timing in ("forward", "backward", "recompute", "backward_input", "backward_weight"):
                    if not (f[timing]["median_s"] > 0 and f[timing]["samples"] >= 1):
                        failures.append("(%s, %d) %s: %s" % (name, size, timing, f[timing]))
                want = 0 if name == NAMES[-1] else size * cm.SEQ * cm.WIDTH * 4
                if f["output_bytes"] != want:
                    failures.append("(%s, %d): output %d bytes, expected %d" % (name, size, f["output_bytes"], want))
        if profile["optimizer_bytes_per_param"] != 8 or not profile["optimizer_s_per_param"] > 0:
            failures.append("optimizer (AdamW): %d bytes, %g s per parameter"
                            % (profile["optimizer_bytes_per_param"], profile["optimizer_s_per_param"]))
        if not profile["p2p"] or not profile["allreduce"]:
            failures.append("2 ranks but %d p2p and %d all-reduce samples" % (len(profile["p2p"]), len(profile["allreduce"])))
        rank0, rank1 = returned(out, 0), returned(out, 1)
        if rank0["result"] != profile:
            failures.append("rank 0's profile_all() is not the file's profile")
        if rank1["result"] is not None:
            failures.append("rank 1's profile_all() returned %r, expected None" % (rank1["result"],))
        # The C++ reader, checking the fingerprint of the model as a program
        # computes it (Profiler.model_fingerprint) ...
        try:
            read = json.loads(varuna._C.read_profile(os.path.join(out, "profile.json"), rank0["fingerprint"]))
            if read["model_fingerprint"] != rank0["fingerprint"] or [p["name"] for p in read["pieces"]] != NAMES:
                failures.append("read_profile gave %s" % read["model_fingerprint"])
        except varuna.ConfigError as error:
            failures.append("the C++ reader refused the profile: %s" % error)
        # ... and run_varuna plans from it (AutoConfig, as a job without
        # --nstages / --chunk_size would).
        machines = os.path.join(out, "machines.txt")
        with open(machines, "w") as f:
            f.write("127.0.0.1 slots=2\n127.0.0.2 slots=2\n")
        dry = subprocess.run([os.path.join(BUILD, "bin", "run_varuna"), "--dry_run", "--machine_list", machines,
                              "--batch_size", "8", "--profile", os.path.join(out, "profile.json"), "--global_store",
                              os.path.join(out, "store"), "--", "./train"], capture_output=True, text=True, timeout=60)
        print(dry.stdout.splitlines()[1] if len(dry.stdout.splitlines()) > 1 else dry.stdout, flush=True)
        if dry.returncode != 0 or "AutoConfig chose" not in dry.stdout or "plan:" not in dry.stdout:
            failures.append("run_varuna --dry_run --profile (%d): %s %s" % (dry.returncode, dry.stdout[-1500:],
                                                                             dry.stderr[-1500:]))


def test_pieces_to_profile_and_adding_to_an_existing_profile():
    with tempfile.TemporaryDirectory() as out:
        # By index and by name; no communication (the adding is what is tested).
        must_run(out, "--sizes", "1,2", "--pieces", "1,piece3", "--no_comm")
        first = load(out)
        if [p["name"] for p in first["pieces"]] != ["piece1", "piece3"]:
            failures.append("pstages_to_profile [1, 'piece3'] profiled %s" % [p["name"] for p in first["pieces"]])
        # Another piece at another size, from the model built on the meta
        # device: the same model (add_to_existing checks the fingerprint).
        must_run(out, "--sizes", "4", "--pieces", "0", "--add", "--meta", "--no_comm")
        second = load(out)
        if second["model_fingerprint"] != first["model_fingerprint"]:
            failures.append("the meta-built model has fingerprint %s, the plain one %s"
                            % (second["model_fingerprint"], first["model_fingerprint"]))
        want = {("piece1", 1), ("piece1", 2), ("piece3", 1), ("piece3", 2), ("piece0", 4)}
        if set(figures(second)) != want:
            failures.append("after adding: %s, expected %s" % (sorted(figures(second)), sorted(want)))
        kept = [k for k in figures(first) if figures(second).get(k) != figures(first)[k]]
        if kept:
            failures.append("adding changed the figures of %s" % kept)
        if [p["name"] for p in second["pieces"]] != ["piece0", "piece1", "piece3"]:
            failures.append("pieces not in model order: %s" % [p["name"] for p in second["pieces"]])
        # from_cache: only what is missing is measured; the rest stays.
        proc = must_run(out, "--sizes", "1,2", "--reuse", "--no_comm")
        third = load(out)
        want = {(n, s) for n in NAMES for s in (1, 2)} | {("piece0", 4)}
        if set(figures(third)) != want:
            failures.append("after from_cache: %s, expected %s" % (sorted(figures(third)), sorted(want)))
        changed = [k for k in figures(second) if figures(third).get(k) != figures(second)[k]]
        if changed:
            failures.append("from_cache measured again %s" % changed)
        if "6 measurements over 2 ranks, reused 4 cached" not in proc.stdout + proc.stderr:
            failures.append("from_cache: expected 6 measurements and 4 reused: %s"
                            % [l for l in (proc.stdout + proc.stderr).splitlines() if "measurements" in l])
        # A changed model is refused on every rank; the file stays as it was.
        with open(os.path.join(out, "profile.json")) as f:
            before = f.read()
        proc = run_job(out, "--sizes", "1", "--add", "--width", "24", "--no_comm")
        with open(os.path.join(out, "profile.json")) as f:
            after = f.read()
        if proc.returncode != 2 or "is stale" not in proc.stderr:
            failures.append("a changed model with add_to_existing: exit %d, %s" % (proc.returncode, proc.stderr[-1500:]))
        if proc.stderr.count("is stale") < 2:
            failures.append("not every rank reported the stale profile: %s" % proc.stderr[-1500:])
        if after != before:
            failures.append("the refused run changed profile.json")


class First(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)

    def forward(self, activation, inputs):
        return torch.tanh(self.embed(inputs["x"]))


class Last(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(16, 4)

    def forward(self, activation, inputs):
        return torch.nn.functional.mse_loss(self.out(activation), inputs["y"])


def small_batch(size, device):
    return {"x": torch.randn(size, 8, device=device), "y": torch.randn(size, 4, device=device)}


def one_rank_profile(model, optimizer, out, **kw):
    profiler = varuna.Profiler(model, small_batch, out_folder=out, warmup=1, repetitions=2,
                               launch_args=varuna.get_launch_args(["profiler_test.py"]), **kw)
    profiler.set_optimizer(optimizer)
    return profiler.profile_all([1, 3])


def test_other_model_forms_and_optimizers():
    out = tempfile.mkdtemp(prefix="varuna-profiler-")
    try:
        cases = [
            ("Sequential, SGD", torch.nn.Sequential(First(), Last()), ["0", "1"],
             lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), 4),
            ("pieces, AdamW", [("embed", First), ("head", Last)], ["embed", "head"], torch.optim.AdamW, 8),
            ("pieces, RMSprop", [("embed", First), ("head", Last)], ["embed", "head"], torch.optim.RMSprop, 4),
            ("pieces, NAdam", [("embed", First), ("head", Last)], ["embed", "head"], "NAdam", 8),
        ]
        for what, model, names, optimizer, state_bytes in cases:
            if callable(optimizer) and not isinstance(optimizer, type):
                optimizer = optimizer(model.parameters())
            profile = one_rank_profile(model, optimizer, os.path.join(out, what.replace(", ", "-")))
            if [p["name"] for p in profile["pieces"]] != names:
                failures.append("%s: pieces %s, expected %s" % (what, [p["name"] for p in profile["pieces"]], names))
            if {k[1] for k in figures(profile)} != {1, 3}:
                failures.append("%s: sizes %s" % (what, sorted(figures(profile))))
            if profile["optimizer_bytes_per_param"] != state_bytes:
                failures.append("%s: %d optimizer bytes per parameter, expected %d"
                                % (what, profile["optimizer_bytes_per_param"], state_bytes))
        try:
            one_rank_profile([("embed", First), ("head", Last)], "adam", os.path.join(out, "bad"),
                             pstages_to_profile=["nope"])
            failures.append("an unknown piece was accepted")
        except varuna.ConfigError as error:
            if "'nope'" not in str(error) or "embed, head" not in str(error) or error.exit_code != 2:
                failures.append("an unknown piece: %s (exit code %s)" % (error, error.exit_code))
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        checks.run(globals())
