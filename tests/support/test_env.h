// Helpers every test shares: its private scratch directory and the build tree.
#pragma once

#include <filesystem>
#include <string>

namespace varuna::test {

// A fresh, empty directory for this test case under VARUNA_TEST_TMPDIR (set by
// varuna_add_test), e.g. build/test-tmp/<test>/<name>.
std::filesystem::path scratchDir(const std::string& name);
// The CMake build directory (VARUNA_BUILD_DIR), where helper binaries live.
std::filesystem::path buildDir();
// The source tree (VARUNA_SOURCE_DIR).
std::filesystem::path sourceDir();

}  // namespace varuna::test
