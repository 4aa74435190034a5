#!/usr/bin/env python3
"""bench/memory: a rank's memory against the floor of what it must hold.

A 4-stage job (P=4, D=1) of the manual-style GPT of tests/python/
cutpoint_model.py at width 1024 and 8 blocks (256 MB of fp32 parameters),
built on the meta device, SGD with momentum; each rank reports its resident
memory (current and peak, /proc and getrusage) once its program has built the
model on meta (the start), after varuna.Varuna() (its stage built), after set_optimizer, and after each of
two steps, beside its floor: its parameters + their gradients + the
optimizer's state (momentum: one tensor per parameter) + the activations it
keeps (micro-batches x the cut's tensor, here small). The figure the target
is about: peak growth from the start over the floor (target <= 1.2).

Both host-memory modes run (Varuna(host_memory=...)): "fast", glibc's
allocator as it is (the default), and "compact", where blocks of 4 MiB and
more get their own mappings and go back to the system when freed; the peer
runs under the same two settings (compact through glibc's
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_, what the runtime sets).

The peer, in the same run: plain PyTorch training one stage's worth of the
same model (blocks / stages blocks, built on meta and materialised, the
same micro-batches accumulated, the same SGD) in one process: what any
training loop pays over the floor (gradient temporaries, the allocator),
beside which the runtime's own share shows.

    .venv/bin/python bench/memory/bench_memory.py [--build build] [--stages 4] [--width 1024] [--blocks 8]
    .venv/bin/python bench/memory/bench_memory.py --smoke     # a small model, seconds

Last line: one JSON object: for each mode, every rank's figures, the worst
ratio and the peer's.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _import_what_training_imports():
    """torch._dynamo and torch.export, before the start on both sides: the
    first torch.optim optimizer imports them in any PyTorch program (~110 MB
    here), and varuna's split uses them; a per-process cost, not the
    model's."""
    import torch._dynamo  # noqa: F401
    import torch.export  # noqa: F401
    import torch.optim  # noqa: F401
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def large_blocks_mapped():
    """Whether a host tensor of 4-30 MiB, allocated after one of its size was
    freed, lives in a mapping of its own (glibc's mallinfo2): True where
    host_memory="compact" took effect, False with glibc's defaults; None
    when this heap cannot tell (its free memory is so large that a block
    beyond it would be over glibc's 32 MiB dynamic threshold, mapped either
    way)."""
    import ctypes
    import torch

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    # More than the heap has free (a free chunk that fits is used whatever
    # the thresholds), over the compact threshold of 4 MiB.
    size = max(6 << 20, libc.mallinfo2().fordblks + (1 << 20))
    if size > 30 << 20:
        return None
    first = torch.ones(size // 4)
    del first
    before = libc.mallinfo2().hblkhd
    block = torch.ones(size // 4)
    mapped = libc.mallinfo2().hblkhd >= before + block.numel() * 4
    del block
    return mapped


def worker(args):
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
    import cutpoint_model as cm
    import varuna
    launch = varuna.get_launch_args()
    torch.set_num_threads(1)
    model = cm.build_on_meta(args.width, args.blocks)
    _import_what_training_imports()
    # The split's first capture imports the rest of torch.export (~430
    # modules, ~36 MB, once per process, whatever the model): measured on a
    # tiny model, reported apart.
    before = rss_now()
    from varuna._capture import capture
    capture(cm.build_on_meta(8, 1), cm.get_batch(2, "cpu"))
    export_imports = rss_now() - before
    # The start: the user's model built (on meta: torch imports its meta
    # kernels then, ~150 MB, whatever runs next); growth from here is Varuna's.
    marks = {"start": (rss_now(), rss_peak())}
    runtime = varuna.Varuna(model, launch.stage_to_rank_map, cm.get_batch, args.batch, launch.chunk_size,
                            launch_args=launch, init_fn=cm.init_fn, seed=cm.INIT_SEED, peer_timeout_s=120,
                            host_memory=args.host_memory)
    del model
    marks["built"] = (rss_now(), rss_peak())
    runtime.set_optimizer(torch.optim.SGD(runtime.parameters(), lr=0.01, momentum=0.9))
    marks["optimizer"] = (rss_now(), rss_peak())
    for step in range(2):
        runtime.step(cm.global_batch(step, args.batch))
        marks["step%d" % (step + 1)] = (rss_now(), rss_peak())
    owned = sum(p.numel() * p.element_size() for p in runtime.parameters())
    micro = launch.chunk_size
    activation = micro * cm.SEQ * args.width * 4 * (args.batch // micro)  # one cut tensor per micro-batch kept
    floor = 3 * owned + activation  # parameters, gradients, momentum; activations
    out = {"rank": launch.rank, "owned_mb": owned / 2**20, "floor_mb": floor / 2**20,
           "large_blocks_mapped": large_blocks_mapped(),
           "export_imports_mb": export_imports / 2**20,
           "marks_mb": {k: [v[0] / 2**20, v[1] / 2**20] for k, v in marks.items()}}
    with open(os.path.join(args.out, "rank_%d.json" % launch.rank), "w") as f:
        json.dump(out, f)


def peer(args):
    """Plain PyTorch: one stage's share of the model, trained alone."""
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
    import cutpoint_model as cm
    torch.set_num_threads(1)
    with torch.device("meta"):
        blocks = torch.nn.ModuleList([cm.Block(args.width) for _ in range(args.blocks // args.stages)])
    _import_what_training_imports()
    marks = {"start": (rss_now(), rss_peak())}
    blocks.to_empty(device="cpu")
    for module in blocks.modules():
        cm.init_fn("", module)
    marks["built"] = (rss_now(), rss_peak())
    opt = torch.optim.SGD(blocks.parameters(), lr=0.01, momentum=0.9)
    marks["optimizer"] = (rss_now(), rss_peak())
    micro = 2
    mask = torch.ones(cm.SEQ, cm.SEQ, dtype=torch.bool).triu(1)
    for step in range(2):
        opt.zero_grad(set_to_none=False)
        for first in range(0, args.batch, micro):
            x = torch.randn(micro, cm.SEQ, args.width)
            for block in blocks:
                x = block(x, mask)
            (x.square().mean() * micro / args.batch).backward()
        opt.step()
        marks["step%d" % (step + 1)] = (rss_now(), rss_peak())
    owned = sum(p.numel() * p.element_size() for p in blocks.parameters())
    activation = micro * cm.SEQ * args.width * 4 * (args.batch // micro)
    out = {"rank": "peer", "owned_mb": owned / 2**20, "floor_mb": (3 * owned + activation) / 2**20,
           "marks_mb": {k: [v[0] / 2**20, v[1] / 2**20] for k, v in marks.items()}}
    with open(os.path.join(args.out, "peer.json"), "w") as f:
        json.dump(out, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--peer", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--host_memory", default="fast", choices=["fast", "compact"])
    p.add_argument("--smoke", action="store_true")
    args, _ = p.parse_known_args()
    if args.worker:
        return worker(args)
    if args.peer:
        return peer(args)
    if args.smoke:
        args.stages, args.width, args.blocks = 2, 256, 2
    result = {"stages": args.stages, "width": args.width, "blocks": args.blocks}
    for mode in ("fast", "compact"):
        ranks, plain = measure(args, mode)
        report(mode, ranks, plain)
        result[mode] = {"ranks": ranks, "worst_peak_growth_over_floor": max(r["ratio"] for r in ranks),
                        "peer": plain, "peer_peak_growth_over_floor": plain["ratio"]}
    print("before the start, once per process: torch.export's imports for the split, %.0f MB"
          % max(r["export_imports_mb"] for r in result["fast"]["ranks"]), file=sys.stderr)
    print(json.dumps(result))


# What the runtime's HostMemory::kCompact sets (worker/src/device/host_memory.cpp),
# for the peer.
COMPACT_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 20), "MALLOC_TRIM_THRESHOLD_": str(32 << 20)}


def measure(args, mode):
    """Every rank's and the peer's figures, with host memory `mode`."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "varuna_launch.py"), "--nstages", str(args.stages),
               "--chunk_size", "2", "--batch_size", str(args.batch), "--", sys.executable, os.path.abspath(__file__),
               "--worker", "--out", out, "--width", str(args.width), "--blocks", str(args.blocks),
               "--batch", str(args.batch), "--host_memory", mode]
        env = dict(os.environ, PYTHONPATH=os.path.join(args.build, "python") + os.pathsep +
                   os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            sys.exit("the job (host memory %s) failed (%d): %s" % (mode, proc.returncode, proc.stderr[-3000:]))
        ranks = [json.load(open(os.path.join(out, "rank_%d.json" % r))) for r in range(args.stages)]
        peer_env = dict(os.environ, **(COMPACT_ENV if mode == "compact" else {}))
        subprocess.run([sys.executable, os.path.abspath(__file__), "--peer", "--out", out, "--width", str(args.width),
                        "--blocks", str(args.blocks), "--stages", str(args.stages), "--batch", str(args.batch)],
                       check=True, timeout=600, env=peer_env)
        plain = json.load(open(os.path.join(out, "peer.json")))
    for r in ranks + [plain]:
        start = r["marks_mb"]["start"]
        r["growth_mb"] = {k: (v[0] - start[0], v[1] - start[0]) for k, v in r["marks_mb"].items() if k != "start"}
        r["peak_growth_mb"] = r["growth_mb"]["step2"][1]
        r["ratio"] = r["peak_growth_mb"] / r["floor_mb"]
    return ranks, plain


def report(mode, ranks, plain):
    print("host memory %s: rank  owned MB  floor MB | growth from start (current / peak), MB: built, optimizer, "
          "step 1, step 2 | peak growth / floor" % mode, file=sys.stderr)
    for r in ranks + [plain]:
        growth = r["growth_mb"]
        print("%4s  %8.0f  %8.0f | %s | %.2f" % (r["rank"], r["owned_mb"], r["floor_mb"], ", ".join(
            "%.0f/%.0f" % growth[k] for k in ("built", "optimizer", "step1", "step2")), r["ratio"]), file=sys.stderr)

if __name__ == "__main__":
    main()
