#!/usr/bin/env python3
"""A rank's memory stays near the floor of what it must hold (bench/memory,
run at its full size): each rank of a 4-stage job of a 256 MB model built on
meta, after two SGD-with-momentum steps, has grown from its start by at most
a generous bound of its parameters + gradients + momentum + activations:
2.5x with host_memory="fast" (glibc as it is: 1.18-1.39x in the benchmark,
depending on how the heap fragmented), 1.5x with "compact" (1.16-1.18x).
The benchmark records the figures with plain PyTorch's beside them
(docs/python.md "Memory per rank")."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checks  # noqa: E402

failures = checks.failures


def test_host_memory_option_round_trips():
    import varuna._C as C
    options = C.Options()
    if options.host_memory != "fast":
        failures.append("host_memory defaults to %r, not 'fast'" % options.host_memory)
    options.host_memory = "compact"
    if options.host_memory != "compact":
        failures.append("host_memory = 'compact' reads back as %r" % options.host_memory)
    try:
        options.host_memory = "tiny"
        failures.append("host_memory = 'tiny' was taken")
    except Exception as error:  # noqa: BLE001 - the binding's ConfigError
        if "host_memory must be 'fast' or 'compact'" not in str(error):
            failures.append("host_memory = 'tiny' refused with %r" % error)


def test_peak_growth_within_a_generous_bound_of_the_floor():
    bench = os.path.join(checks.SOURCE, "bench", "memory", "bench_memory.py")
    build = os.environ.get("VARUNA_BUILD_DIR", os.path.join(checks.SOURCE, "build"))
    proc = subprocess.run([sys.executable, bench, "--build", build], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError("bench_memory failed (%d): %s" % (proc.returncode, proc.stderr[-3000:]))
    print(proc.stderr, flush=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode, bound in (("fast", 2.5), ("compact", 1.5)):
        for rank in result[mode]["ranks"]:
            # Compact must give large blocks mappings of their own. Fast
            # leaves glibc's defaults, under which the probe's block is
            # mapped or not depending on the heap's history (its dynamic
            # threshold; a CI run on 2026-11-26 saw a mapped block once):
            # reported by the bench, not judged. None: that rank's heap could not tell
            # (host_memory_test checks the setting itself).
            if mode == "compact" and rank["large_blocks_mapped"] not in (None, True):
                failures.append("host memory %s: rank %d's large host blocks are %s their own mappings" % (
                    mode, rank["rank"], "in" if rank["large_blocks_mapped"] else "not in"))
            if rank["ratio"] > bound:
                failures.append("host memory %s: rank %d grew by %.0f MB, %.2fx its floor of %.0f MB (bound %.1fx)" % (
                    mode, rank["rank"], rank["peak_growth_mb"], rank["ratio"], rank["floor_mb"], bound))


if __name__ == "__main__":
    checks.run(globals())
