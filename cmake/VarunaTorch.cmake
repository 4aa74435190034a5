# Finds libtorch (from the project's Python virtual environment, see
# scripts/setup.sh) and exposes it as the imported target varuna::torch.
#
# The pip wheel of torch ships CUDA, cuDNN and NCCL as separate nvidia-* wheels
# that libtorch_cuda.so finds through its $ORIGIN rpath. The linker does not
# expand that rpath, so it would pick up an older system NCCL; we point it at the
# wheel's libraries explicitly (rpath-link for linking, rpath for running).
# We compile no .cu files; naming the architectures skips Caffe2's GPU probing
# (a try_run that needs a GPU and trips over the C++20 dialect).
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "8.0;9.0")
endif()
find_package(Torch REQUIRED)
include(${CMAKE_CURRENT_LIST_DIR}/varunaStdcxxFirst.cmake)

add_library(varuna_torch INTERFACE)
add_library(varuna::torch ALIAS varuna_torch)
# libstdc++ before libtorch (cmake/varunaTorchTarget.cmake says why).
target_link_libraries(varuna_torch INTERFACE ${VARUNA_STDCXX_BEFORE_TORCH} ${TORCH_LIBRARIES})
# Torch's own flags (e.g. -D_GLIBCXX_USE_CXX11_ABI) as usage requirements.
target_compile_options(varuna_torch INTERFACE ${TORCH_CXX_FLAGS})

get_filename_component(_varuna_torch_lib_dir "${TORCH_LIBRARY}" DIRECTORY)
file(GLOB _varuna_nvidia_lib_dirs "${_varuna_torch_lib_dir}/../../nvidia/*/lib")
foreach(_dir IN LISTS _varuna_nvidia_lib_dirs)
  get_filename_component(_dir "${_dir}" REALPATH)
  target_link_options(varuna_torch INTERFACE "LINKER:-rpath-link,${_dir}" "LINKER:-rpath,${_dir}")
endforeach()

# Gloo's headers are not in the wheel; libtorch has Gloo compiled in, so only the
# declarations are needed (Debian's libgloo-dev). Nothing links Debian's libgloo.
find_path(VARUNA_GLOO_INCLUDE_DIR gloo/context.h REQUIRED)
target_include_directories(varuna_torch SYSTEM INTERFACE "${VARUNA_GLOO_INCLUDE_DIR}")
target_compile_definitions(varuna_torch INTERFACE USE_C10D_GLOO)

# NCCL: compiled whenever libtorch has CUDA (AUTO), so the GPU path never rots.
set(VARUNA_HAVE_NCCL OFF)
if(NOT VARUNA_WITH_NCCL STREQUAL "OFF")
  if(TARGET torch_cuda OR EXISTS "${_varuna_torch_lib_dir}/libtorch_cuda.so")
    find_path(VARUNA_NCCL_INCLUDE_DIR nccl.h
      HINTS "${_varuna_torch_lib_dir}/../../nvidia/nccl/include" ${CUDAToolkit_INCLUDE_DIRS})
    if(VARUNA_NCCL_INCLUDE_DIR)
      set(VARUNA_HAVE_NCCL ON)
    endif()
  endif()
  if(VARUNA_WITH_NCCL STREQUAL "ON" AND NOT VARUNA_HAVE_NCCL)
    message(FATAL_ERROR "VARUNA_WITH_NCCL=ON but libtorch has no CUDA or nccl.h was not found. "
                        "Use a CUDA build of torch or configure with -DVARUNA_WITH_NCCL=OFF.")
  endif()
endif()
if(VARUNA_HAVE_NCCL)
  target_include_directories(varuna_torch SYSTEM INTERFACE "${VARUNA_NCCL_INCLUDE_DIR}" ${CUDAToolkit_INCLUDE_DIRS})
  target_compile_definitions(varuna_torch INTERFACE USE_C10D_NCCL VARUNA_HAVE_NCCL=1)
endif()
message(STATUS "varuna: libtorch ${Torch_VERSION} from ${_varuna_torch_lib_dir}; NCCL path: ${VARUNA_HAVE_NCCL}")
