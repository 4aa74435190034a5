# Installed beside varunaConfig.cmake: varuna::libtorch, what the installed
# varuna::worker needs of libtorch, made from the Torch package that the
# user's project found (so the install prefix holds no path of the machine
# that built it). In the build tree varuna::torch (cmake/VarunaTorch.cmake)
# plays its part, with what only the runtime's own sources need besides
# (Gloo's headers, NCCL); the installed one has another name because an
# export resolves any name of a build-tree target.
#
# As there: the torch wheel's CUDA, cuDNN and NCCL libraries (nvidia-* wheels)
# that libtorch_cuda.so finds through its $ORIGIN rpath are given to the
# linker (rpath-link; it would take an older system NCCL otherwise) and to
# the program (rpath).
if(NOT TARGET varuna::libtorch)
  add_library(varuna::libtorch INTERFACE IMPORTED)
  include(${CMAKE_CURRENT_LIST_DIR}/varunaStdcxxFirst.cmake)
  set_property(TARGET varuna::libtorch PROPERTY INTERFACE_LINK_LIBRARIES ${VARUNA_STDCXX_BEFORE_TORCH} ${TORCH_LIBRARIES})
  # Torch's own flags (e.g. -D_GLIBCXX_USE_CXX11_ABI) as usage requirements.
  set_property(TARGET varuna::libtorch PROPERTY INTERFACE_COMPILE_OPTIONS ${TORCH_CXX_FLAGS})
  get_filename_component(_varuna_torch_lib_dir "${TORCH_LIBRARY}" DIRECTORY)
  file(GLOB _varuna_nvidia_lib_dirs "${_varuna_torch_lib_dir}/../../nvidia/*/lib")
  foreach(_varuna_dir IN LISTS _varuna_nvidia_lib_dirs)
    get_filename_component(_varuna_dir "${_varuna_dir}" REALPATH)
    set_property(TARGET varuna::libtorch APPEND PROPERTY INTERFACE_LINK_OPTIONS
      "LINKER:-rpath-link,${_varuna_dir}" "LINKER:-rpath,${_varuna_dir}")
  endforeach()
  unset(_varuna_torch_lib_dir)
  unset(_varuna_nvidia_lib_dirs)
  unset(_varuna_dir)
endif()
