
#include "varuna/common/errors.h"
#include "varuna/worker/loss_scaler.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

using namespace varuna;

TEST_CASE("dynamic loss scale backs off on overflow and grows after clean steps", "[loss_scaler]") {
  LossScaler scaler({.initialScale = 1024, .minScale = 64, .growthFactor = 2, .backoffFactor = 0.5, .growthInterval = 3});
  CHECK(scaler.scale() == 1024);
  scaler.update(true);
  CHECK(scaler.scale() == 512);
  scaler.update(false);
  scaler.update(false);
  CHECK(scaler.scale() == 512);
  scaler.update(false);  // third clean step in a row
  CHECK(scaler.scale() == 1024);
  CHECK(scaler.cleanSteps() == 0);
  scaler.update(false);
  scaler.update(true);  // an overflow resets the clean-step count
  scaler.update(false);
  scaler.update(false);
  CHECK(scaler.scale() == 512);
}

TEST_CASE("the scale never falls below the minimum", "[loss_scaler]") {
  LossScaler scaler({.initialScale = 4, .minScale = 1});
  for (int i = 0; i < 10; ++i) scaler.update(true);
  CHECK(scaler.scale() == 1);
}

TEST_CASE("a static scale never changes", "[loss_scaler]") {
  LossScaler scaler({.dynamic = false, .initialScale = 128});
  scaler.update(true);
  for (int i = 0; i < 5000; ++i) scaler.update(false);
  CHECK(scaler.scale() == 128);
}

TEST_CASE("invalid loss-scale options are refused", "[loss_scaler]") {
  CHECK_THROWS_AS(LossScaler({.initialScale = 0}), ConfigError);
  CHECK_THROWS_AS(LossScaler({.backoffFactor = 1.5}), ConfigError);
  CHECK_THROWS_AS(LossScaler({.growthFactor = 0.5}), ConfigError);
  CHECK_THROWS_AS(LossScaler({.growthInterval = 0}), ConfigError);
}
