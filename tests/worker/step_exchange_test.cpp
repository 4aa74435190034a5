// StepExchange: the job-wide exchange of a step, named; the all-reduce sums
// the shares of every rank, and salvage relays the summed result on the wire.
#include <catch2/catch.hpp>

#include "pipeline/step_exchange.h"

using namespace varuna;

TEST_CASE("step exchange: the summed shares name the loss, the norm and the checkpoint request") {
  const auto scalar = [](double v) { return torch::tensor(v, torch::kDouble); };
  const auto lossSum = scalar(2.5);
  auto summed = StepExchange::share(lossSum, scalar(4.0), false);
  summed += StepExchange::share(scalar(1.5), scalar(5.0), true);  // another rank's share
  const StepExchange exchange = StepExchange::fromTensor(summed);
  CHECK(exchange.lossSum == 4.0);
  CHECK(exchange.sumOfSquares == 9.0);
  CHECK(exchange.checkpointRequested);
  CHECK_FALSE(StepExchange::fromTensor(StepExchange::share(lossSum, scalar(1.0), false)).checkpointRequested);
}

TEST_CASE("step exchange: the wire form round-trips and any other length is refused") {
  const StepExchange exchange{12.25, 0.5, true};
  const auto wire = exchange.toWire();
  REQUIRE(wire.size() == proto::kExchangeValues);
  const auto back = StepExchange::fromWire(wire);
  REQUIRE(back);
  CHECK(back->lossSum == 12.25);
  CHECK(back->sumOfSquares == 0.5);
  CHECK(back->checkpointRequested);
  CHECK_FALSE(StepExchange::fromWire({}));  // a report with no exchange
  CHECK_FALSE(StepExchange::fromWire({1.0, 2.0}));
  CHECK_FALSE(StepExchange::fromWire({1.0, 2.0, 0.0, 4.0}));
}
