# One precompiled header of libtorch's C++ API, shared by every target that
# compiles against libtorch (the worker, its tests, the examples and
# benchmarks; not the Python module, see below).
#
# Parsing libtorch's headers is about half of each such translation unit's
# compile time (gcc -ftime-report on worker/src/pipeline/varuna_step.cpp:
# parsing 47 %, template instantiation 30 %, code generation 23 %), and 52
# translation units did it (before the unity builds: VARUNA_UNITY_BUILD). With the header precompiled, that file takes 18.3 s
# of CPU instead of 36.8 s, and a clean-clone set-up and build on a 2-core VM
# took 17 minutes instead of about 22 (2026-11-27). gcc uses a precompiled header only when the flags that
# shape code generation match (-fPIC among them), so every target that reuses
# it is compiled position-independent, executables too; gcc silently parses
# the headers as usual where they do not match, so a mismatch costs time,
# never correctness. -DVARUNA_TORCH_PCH=OFF turns it off.
#
# The manager never includes libtorch: only targets that link the worker or
# libtorch directly get the header (varuna_reuse_torch_pch below). A target
# with precompiled headers of its own keeps them, and one built with hidden
# visibility (the Python module, a unity build: python/CMakeLists.txt) gets
# none: a header precompiled without it would not match (gcc would not say
# so; clang refuses). Sanitizer builds (VARUNA_SANITIZE)
# compile without it: their flags would not match it either.
option(VARUNA_TORCH_PCH "Precompile libtorch's headers once for every target that compiles against them" ON)

set(VARUNA_TORCH_PCH_USERS varuna::torch varuna_torch varuna::worker varuna_worker varuna_example_gpt
    varuna_worker_test_support)

function(varuna_add_torch_pch)
  if(NOT VARUNA_TORCH_PCH OR VARUNA_SANITIZE)
    return()
  endif()
  add_library(varuna_torch_pch OBJECT ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/torch_pch.cpp)
  target_link_libraries(varuna_torch_pch PRIVATE varuna::torch)
  target_compile_features(varuna_torch_pch PRIVATE cxx_std_20)
  target_compile_options(varuna_torch_pch PRIVATE -fPIC)
  target_precompile_headers(varuna_torch_pch PRIVATE <torch/torch.h>)
endfunction()

# Gives the precompiled header to every target under `dir` (recursively) that
# links one of VARUNA_TORCH_PCH_USERS directly. Called once every target exists.
function(varuna_reuse_torch_pch dir)
  if(NOT TARGET varuna_torch_pch)
    return()
  endif()
  get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(target IN LISTS targets)
    get_target_property(type ${target} TYPE)
    if(type STREQUAL "INTERFACE_LIBRARY" OR type STREQUAL "UTILITY" OR target STREQUAL "varuna_torch_pch")
      continue()
    endif()
    get_target_property(own ${target} PRECOMPILE_HEADERS)
    get_target_property(visibility ${target} CXX_VISIBILITY_PRESET)
    if(own OR visibility STREQUAL "hidden")
      continue()
    endif()
    get_target_property(links ${target} LINK_LIBRARIES)
    set(uses_torch FALSE)
    foreach(link IN LISTS links)
      string(REGEX REPLACE "^\\$<BUILD_INTERFACE:(.*)>$" "\\1" link "${link}")
      if(link IN_LIST VARUNA_TORCH_PCH_USERS)
        set(uses_torch TRUE)
      endif()
    endforeach()
    if(uses_torch)
      target_precompile_headers(${target} REUSE_FROM varuna_torch_pch)
      # -Winvalid-pch: a header gcc could not use says so in the build log.
      target_compile_options(${target} PRIVATE -fPIC -Winvalid-pch -Wno-error=invalid-pch)
    endif()
  endforeach()
  get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(subdir IN LISTS subdirs)
    varuna_reuse_torch_pch("${subdir}")
  endforeach()
endfunction()
