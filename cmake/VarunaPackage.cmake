# The worker runtime as a CMake package. `cmake --install build --prefix P`
# puts the static, position-independent libvaruna_worker.a and
# libvaruna_common.a (worker/ and common/ add them to the export set), their
# headers, and lib/cmake/varuna/ under P; another project then builds against
# them with P and torch's cmake prefix in CMAKE_PREFIX_PATH:
#   find_package(varuna REQUIRED)
#   target_link_libraries(app PRIVATE varuna::worker)
# (docs/worker-api.md; tests/install/ does exactly that).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# The archives of a sanitizer build need the sanitizer runtimes in the
# program that links them (varuna_warnings, which brings them in the build
# tree, stays there).
if(VARUNA_SANITIZE)
  foreach(_varuna_target varuna_worker varuna_common)
    set_property(TARGET ${_varuna_target} APPEND PROPERTY INTERFACE_LINK_OPTIONS
      "$<INSTALL_INTERFACE:-fsanitize=address,undefined>")
  endforeach()
endif()

set(_varuna_cmake_dir "${CMAKE_INSTALL_LIBDIR}/cmake/varuna")
install(EXPORT varunaTargets NAMESPACE varuna:: DESTINATION "${_varuna_cmake_dir}")
# The config names the torch version the archives were compiled against: a
# libtorch of another version has another ABI, and is refused at configure.
set(VARUNA_PACKAGE_TORCH_VERSION "${Torch_VERSION}")
configure_package_config_file("${CMAKE_CURRENT_LIST_DIR}/varunaConfig.cmake.in"
  "${CMAKE_BINARY_DIR}/cmake/varunaConfig.cmake" INSTALL_DESTINATION "${_varuna_cmake_dir}")
# 0.x: a minor version may change the API.
write_basic_package_version_file("${CMAKE_BINARY_DIR}/cmake/varunaConfigVersion.cmake"
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_BINARY_DIR}/cmake/varunaConfig.cmake" "${CMAKE_BINARY_DIR}/cmake/varunaConfigVersion.cmake"
  "${CMAKE_CURRENT_LIST_DIR}/varunaTorchTarget.cmake" "${CMAKE_CURRENT_LIST_DIR}/varunaStdcxxFirst.cmake"
  DESTINATION "${_varuna_cmake_dir}")
