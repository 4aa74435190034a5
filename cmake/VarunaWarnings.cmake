# One interface target carries the project's warning and sanitizer flags; every
# first-party target links it PRIVATE, so third-party headers are never affected.
# Warnings are errors in the project's own CI (Debian's GCC); a build with
# another compiler (a GPU node's, scripts/gpu_check.sh) turns that off with
# -DVARUNA_WERROR=OFF, so a new compiler's new warning is not a failed check.
option(VARUNA_WERROR "Treat the project's own warnings as errors" ON)
add_library(varuna_warnings INTERFACE)
target_compile_options(varuna_warnings INTERFACE -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers)
if(VARUNA_WERROR)
  target_compile_options(varuna_warnings INTERFACE -Werror)
endif()
if(VARUNA_SANITIZE)
  target_compile_options(varuna_warnings INTERFACE -fsanitize=address,undefined -fno-omit-frame-pointer)
  target_link_options(varuna_warnings INTERFACE -fsanitize=address,undefined)
endif()
