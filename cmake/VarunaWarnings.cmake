# One interface target carries the project's warning and sanitizer flags; every
# first-party target links it PRIVATE, so third-party headers are never affected.
add_library(varuna_warnings INTERFACE)
target_compile_options(varuna_warnings INTERFACE -Wall -Wextra -Werror -Wno-unused-parameter -Wno-missing-field-initializers)
if(VARUNA_SANITIZE)
  target_compile_options(varuna_warnings INTERFACE -fsanitize=address,undefined -fno-omit-frame-pointer)
  target_link_options(varuna_warnings INTERFACE -fsanitize=address,undefined)
endif()
