# VARUNA_STDCXX_BEFORE_TORCH: what to link right before libtorch so that a
# program's own calls into the C++ standard library bind to a real libstdc++,
# never to libtorch.so's copy.
#
# Some torch wheels (2.11.0+cu130's) build libtorch.so with parts of a static
# libstdc++ (std::filesystem, std::chrono's time zones, ...) and export them.
# Whatever the linker meets first defines a symbol for the program:
#  - with a shared libstdc++ (Debian's g++), libstdc++.so.6 must come before
#    libtorch.so among the program's libraries, or the dynamic linker binds
#    std::filesystem::remove_all to libtorch's copy;
#  - with a toolchain that only has a static libstdc++.a (the GPU image's
#    GCC in /opt/gcc), the archive must be searched before libtorch.so is
#    seen, or the undefined std:: symbols are left to libtorch's copy.
# Either way libtorch's copy crashed (a call through a null pointer on an
# H100 and an H200 in every remove_all: checkpoints, tests, Python workers).
# `-lstdc++` right before the torch libraries covers both.
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang" AND NOT CMAKE_CXX_FLAGS MATCHES "-stdlib=libc\\+\\+")
  set(VARUNA_STDCXX_BEFORE_TORCH stdc++)
else()
  set(VARUNA_STDCXX_BEFORE_TORCH "")
endif()
