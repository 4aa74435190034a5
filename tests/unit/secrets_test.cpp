// secrets.h: a constant-time comparison that is still a comparison, and an
// environment variable scrubbed once read (the whole flow, /proc/<pid>/environ
// and children included, is tests/python/secret_env_test.py).
#include "varuna/common/secrets.h"

#include <cstdlib>
#include <string>

#include <catch2/catch.hpp>

using namespace varuna;

TEST_CASE("constantTimeEquals compares like ==", "[secrets]") {
  CHECK(constantTimeEquals("", ""));
  CHECK(constantTimeEquals("tok-0123456789abcdef", "tok-0123456789abcdef"));
  CHECK_FALSE(constantTimeEquals("tok-0123456789abcdef", "tok-0123456789abcdeF"));  // last byte
  CHECK_FALSE(constantTimeEquals("tok-0123456789abcdef", "Tok-0123456789abcdef"));  // first byte
  CHECK_FALSE(constantTimeEquals("tok", "tok-"));                                  // a prefix
  CHECK_FALSE(constantTimeEquals("tok-", "tok"));
  CHECK_FALSE(constantTimeEquals("", "x"));
  CHECK_FALSE(constantTimeEquals(std::string("a\0b", 3), std::string("a\0c", 3)));  // past a NUL
}

TEST_CASE("a scrubbed variable is gone and its value overwritten", "[secrets]") {
  REQUIRE(::setenv("VARUNA_SECRETS_TEST", "s3cret-value", 1) == 0);
  const char* value = std::getenv("VARUNA_SECRETS_TEST");
  REQUIRE(value != nullptr);
  scrubEnvironmentVariable("VARUNA_SECRETS_TEST");
  CHECK(std::getenv("VARUNA_SECRETS_TEST") == nullptr);
  // glibc keeps a setenv'd string alive after unsetenv: its bytes are zero now.
  CHECK(std::string(value, 12) == std::string(12, '\0'));
  scrubEnvironmentVariable("VARUNA_SECRETS_TEST");  // not set: nothing happens
  CHECK(std::getenv("VARUNA_SECRETS_TEST") == nullptr);
}
