# varuna_add_test(NAME name SOURCES ... LIBS ... LABELS unit|integration|e2e|gpu
#                 [TIMEOUT seconds] [OWN_MAIN] [SKIP_RETURN_CODE code])
# One Catch2 executable registered as one CTest test with a timeout, labels and a
# private scratch directory (VARUNA_TEST_TMPDIR) so parallel ctest runs never
# share files.
find_package(Catch2 REQUIRED)

# Python tests and the Python benchmarks' smoke runs use the project's virtual
# environment (scripts/setup.sh creates it with the pinned torch).
set(VARUNA_PYTHON "${CMAKE_SOURCE_DIR}/.venv/bin/python" CACHE FILEPATH "Python with the pinned torch")

function(varuna_add_test)
  cmake_parse_arguments(T "OWN_MAIN" "NAME;TIMEOUT;SKIP_RETURN_CODE" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  add_executable(${T_NAME} ${T_SOURCES})
  # Four test files compiled as one (a unity build): Catch2's, Asio's and
  # libtorch's templates instantiated once per four files, not per file.
  set_target_properties(${T_NAME} PROPERTIES UNITY_BUILD ${VARUNA_UNITY_BUILD} UNITY_BUILD_BATCH_SIZE 4)
  if(T_OWN_MAIN)
    target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} varuna_warnings)
  else()
    target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} varuna_test_main varuna_warnings)
  endif()
  set(_tmp "${CMAKE_BINARY_DIR}/test-tmp/${T_NAME}")
  add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  set_tests_properties(${T_NAME} PROPERTIES
    TIMEOUT ${T_TIMEOUT}
    LABELS "${T_LABELS}"
    ENVIRONMENT "VARUNA_TEST_TMPDIR=${_tmp};VARUNA_BUILD_DIR=${CMAKE_BINARY_DIR};VARUNA_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
  if(T_SKIP_RETURN_CODE)
    set_tests_properties(${T_NAME} PROPERTIES SKIP_RETURN_CODE ${T_SKIP_RETURN_CODE})
  endif()
endfunction()

# varuna_tests_one_thread_each(): every test of the calling folder runs its
# processes with one intra-op thread (OMP_NUM_THREADS=1) unless the test sets
# its own. A test starts up to 4 worker processes and CTest runs two tests at
# once on a 2-core machine: with torch's default of a thread per core, 16
# threads share 2 cores and OpenMP's spin-waits eat the time (the example
# job of python_hf_test: 26 s alone, 20 s with one thread each). The tests'
# figures do not depend on it: each compares with a reference computed under
# the same setting. Call at the end of a folder's CMakeLists.txt (before CMake
# 3.28 set_tests_properties reaches only the calling folder's tests).
function(varuna_tests_one_thread_each)
  get_property(_tests DIRECTORY PROPERTY TESTS)
  foreach(_test IN LISTS _tests)
    get_test_property(${_test} ENVIRONMENT _env)
    if(NOT _env MATCHES "OMP_NUM_THREADS=")
      set_property(TEST ${_test} APPEND PROPERTY ENVIRONMENT "OMP_NUM_THREADS=1")
    endif()
  endforeach()
endfunction()
