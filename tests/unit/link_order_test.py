#!/usr/bin/env python3
"""Every program and module that links libtorch takes the C++ standard library
from libstdc++, never from libtorch.so (cmake/varunaStdcxxFirst.cmake): some
torch wheels (2.11.0+cu130's) export a static copy of parts of libstdc++ from
libtorch.so, and a std::filesystem::remove_all bound to it crashed on GPU
nodes. With a shared libstdc++, libstdc++.so.6 must come before every
libtorch library among the binary's DT_NEEDED entries; with a static one
(no libstdc++ entry), the binary must define std::filesystem itself.

    link_order_test.py BINARY...
"""
import subprocess
import sys

REMOVE_ALL = "_ZNSt10filesystem10remove_allERKNS_7__cxx114pathE"


def needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def defines_filesystem(path):
    out = subprocess.run(["nm", "--defined-only", path], capture_output=True, text=True).stdout
    return REMOVE_ALL in out


def problem(path):
    libs = needed(path)
    torch = [i for i, name in enumerate(libs) if name.startswith("libtorch") or name.startswith("libc10")]
    if not torch:
        return None  # no libtorch: nothing to shadow
    stdcxx = [i for i, name in enumerate(libs) if name.startswith("libstdc++")]
    if stdcxx:
        if stdcxx[0] < torch[0]:
            return None
        return "libstdc++ comes after %s among its libraries: %s" % (libs[torch[0]], ", ".join(libs))
    if defines_filesystem(path):
        return None  # a static libstdc++, linked in before libtorch
    return "no libstdc++ among its libraries and no std::filesystem of its own: %s" % ", ".join(libs)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    failures = [(path, why) for path in sys.argv[1:] for why in [problem(path)] if why]
    for path, why in failures:
        print("FAIL %s: %s" % (path, why))
    print("%d of %d binaries take std:: from libstdc++" % (len(sys.argv) - 1 - len(failures), len(sys.argv) - 1))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
