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
# `-lstdc++` right before the torch libraries covers both at link time, but a
# static libstdc++ is not enough at run time: in the Python module it met the
# process's shared libstdc++.so.6 (loaded by torch's own libraries) and
# crashed in iostreams (an H200, std::ostream::_M_insert via
# std::codecvt). One libstdc++ per process: where the compiler has only a
# static libstdc++, link the shared libstdc++.so.6 that torch's libraries load,
# by its path; the compiler's libstdc++.a then only fills in what that one
# lacks.
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang" AND NOT CMAKE_CXX_FLAGS MATCHES "-stdlib=libc\\+\\+")
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so
                  OUTPUT_VARIABLE _varuna_compiler_libstdcxx OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(IS_ABSOLUTE "${_varuna_compiler_libstdcxx}")
    set(VARUNA_STDCXX_BEFORE_TORCH stdc++)
  else()
    # A toolchain outside the system (/opt/gcc) may leave the multiarch
    # folder out of CMake's search path: it is named here.
    find_library(VARUNA_SHARED_LIBSTDCXX NAMES libstdc++.so.6
                 PATHS /usr/lib/${CMAKE_SYSTEM_PROCESSOR}-linux-gnu /lib/${CMAKE_SYSTEM_PROCESSOR}-linux-gnu /usr/lib64
                 DOC "the shared libstdc++ linked where the compiler has only a static one")
    if(VARUNA_SHARED_LIBSTDCXX)
      message(STATUS "varuna: ${CMAKE_CXX_COMPILER} has no shared libstdc++; linking ${VARUNA_SHARED_LIBSTDCXX}")
      set(VARUNA_STDCXX_BEFORE_TORCH "${VARUNA_SHARED_LIBSTDCXX}")
    else()
      message(WARNING "varuna: ${CMAKE_CXX_COMPILER} has no shared libstdc++ and no libstdc++.so.6 was found: "
                      "the Python module will hold a static copy beside torch's shared one (set VARUNA_SHARED_LIBSTDCXX)")
      set(VARUNA_STDCXX_BEFORE_TORCH stdc++)
    endif()
  endif()
else()
  set(VARUNA_STDCXX_BEFORE_TORCH "")
endif()
