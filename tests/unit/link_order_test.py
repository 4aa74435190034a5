#!/usr/bin/env python3
"""Every program and module that links libtorch takes the C++ standard library
from libstdc++, never from libtorch.so (cmake/varunaStdcxxFirst.cmake): some
torch wheels (2.11.0+cu130's) export a static copy of parts of libstdc++ from
libtorch.so, and a std::filesystem::remove_all bound to it crashed on GPU
nodes. libstdc++.so.6 must come before every libtorch library among the
binary's DT_NEEDED entries. A static libstdc++ is refused too: linked into
the Python module it met torch's shared one in the same process and crashed
in iostreams on an H200.

    link_order_test.py BINARY...
    link_order_test.py --choice CMAKE_MODULE CXX
        what the module picks with the compiler CXX (libstdc++ by name) and
        with a compiler that has only a static libstdc++ (the shared
        libstdc++.so.6, by its path)
"""
import os
import subprocess
import sys
import tempfile

def needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


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
    return "no shared libstdc++ among its libraries (a static copy beside torch's): %s" % ", ".join(libs)


STATIC_ONLY_CXX = """#!/bin/sh
# A compiler with only a static libstdc++: it cannot name a libstdc++.so.
case "$*" in *-print-file-name=libstdc++.so*) echo libstdc++.so; exit 0;; esac
exec "%s" "$@"
"""


def choice(module, cxx, scratch):
    """VARUNA_STDCXX_BEFORE_TORCH as the module sets it in a project built with cxx."""
    src = os.path.join(scratch, "src-" + os.path.basename(cxx))
    os.makedirs(src)
    with open(os.path.join(src, "CMakeLists.txt"), "w") as f:
        f.write("cmake_minimum_required(VERSION 3.20)\nproject(probe CXX)\ninclude(%s)\n"
                "message(STATUS \"CHOICE=${VARUNA_STDCXX_BEFORE_TORCH}\")\n" % module)
    out = subprocess.run(["cmake", "-S", src, "-B", os.path.join(src, "build"), "-DCMAKE_CXX_COMPILER=" + cxx],
                         capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if "CHOICE=" in line:
            return line.split("CHOICE=", 1)[1]
    raise AssertionError("cmake printed no choice (exit %d): %s %s" % (out.returncode, out.stdout, out.stderr))


def check_choice(module, cxx):
    failures = []
    with tempfile.TemporaryDirectory() as scratch:
        real = choice(module, cxx, scratch)
        if real != "stdc++":
            failures.append("with %s: %r, not stdc++" % (cxx, real))
        fake = os.path.join(scratch, "static-only-c++")
        with open(fake, "w") as f:
            f.write(STATIC_ONLY_CXX % cxx)
        os.chmod(fake, 0o755)
        static = choice(module, fake, scratch)
        if not (os.path.isabs(static) and os.path.basename(static) == "libstdc++.so.6" and os.path.exists(static)):
            failures.append("with a static-only libstdc++: %r, not the path of a libstdc++.so.6" % static)
        print("choice: %s with %s; %s with a static-only libstdc++" % (real, cxx, static))
    return failures


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if sys.argv[1] == "--choice":
        failures = check_choice(sys.argv[2], sys.argv[3])
        for why in failures:
            print("FAIL " + why)
        sys.exit(1 if failures else 0)
    failures = [(path, why) for path in sys.argv[1:] for why in [problem(path)] if why]
    for path, why in failures:
        print("FAIL %s: %s" % (path, why))
    print("%d of %d binaries take std:: from libstdc++" % (len(sys.argv) - 1 - len(failures), len(sys.argv) - 1))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
