// The communication backend choice (devices.h) and the point-to-point path
// through host buffers that a Gloo job on CUDA takes (comm.h). On CPU the
// staging is forced (CommOptions::stageThroughHost), so the same bookkeeping
// runs here that runs on a GPU: a receive reaches its (even non-contiguous)
// tensor through its host buffer when waitFor completes it, a send's host
// copy is taken at once, and an interrupted receive writes nothing.
// libtorch's headers (through comm.h) define a CHECK of their own: Catch2's
// comes after them.
#include "comm/comm.h"

#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <catch2/catch.hpp>
#include <future>
#include <thread>

using namespace varuna;
using namespace std::chrono_literals;

namespace {

// Two ranks of one job in this process, on a store the test hosts.
struct TwoRanks {
  c10::intrusive_ptr<c10d::TCPStore> store;
  std::unique_ptr<Communicator> ranks[2];

  TwoRanks() {
    c10d::TCPStoreOptions opts;
    opts.port = 0;
    opts.isServer = true;
    opts.waitWorkers = false;
    opts.timeout = 30s;
    store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
    const auto map = StageToRankMap::parse("0;1;");
    auto make = [&](int rank) {
      CommOptions o;
      o.masterAddr = "127.0.0.1";
      o.masterPort = store->getPort();
      o.rank = rank;
      o.worldSize = 2;
      o.backend = CommBackend::kGloo;
      o.stageThroughHost = true;
      o.timeout = 30s;
      return std::make_unique<Communicator>(o, map);
    };
    // Each constructor waits for the other to join the world group.
    auto second = std::async(std::launch::async, make, 1);
    ranks[0] = make(0);
    ranks[1] = second.get();
  }
};

}  // namespace

TEST_CASE("comm backend: parsed, resolved against the device, refused where it cannot work", "[comm]") {
  CHECK(parseCommBackend("gloo") == CommBackend::kGloo);
  CHECK(toString(parseCommBackend("nccl")) == "nccl");
  CHECK_THROWS_WITH(parseCommBackend("mpi"), Catch::Contains("use auto, gloo or nccl"));
  CHECK(resolveCommBackend(CommBackend::kAuto, torch::kCPU) == CommBackend::kGloo);
  CHECK(resolveCommBackend(CommBackend::kGloo, torch::Device(torch::kCUDA, 0)) == CommBackend::kGloo);
  CHECK_THROWS_WITH(resolveCommBackend(CommBackend::kNccl, torch::kCPU), Catch::Contains("--device cuda"));
  if (!torch::cuda::is_available()) {
    CHECK_THROWS_WITH(cudaDeviceForLocalRank(0, CommBackend::kGloo), Catch::Contains("no CUDA device is visible"));
  } else {
    const auto gpus = static_cast<int>(torch::cuda::device_count());
    CHECK(cudaDeviceForLocalRank(gpus, CommBackend::kGloo).index() == 0);  // shared
    CHECK_THROWS_WITH(cudaDeviceForLocalRank(gpus, CommBackend::kNccl), Catch::Contains("--comm_backend gloo"));
  }
}

TEST_CASE("staged point-to-point: a receive reaches its tensor when its wait completes", "[comm]") {
  TwoRanks job;
  auto sent = torch::arange(12, torch::kFloat).reshape({3, 4});
  auto received = torch::zeros({4, 3}).t();  // a non-contiguous target
  auto recvWork = job.ranks[1]->recv(received, 0, /*tag=*/5);
  job.ranks[0]->waitFor(job.ranks[0]->send(sent, 1, 5), "sending");
  // (Not recvWork->wait(): a Gloo receive's wait is not idempotent, which is
  // why every point-to-point wait goes through waitFor, once.)
  job.ranks[1]->waitFor(recvWork, "receiving");
  CHECK(torch::equal(received, sent));

  // A sent tensor changed right after send() does not change what arrives:
  // the host copy was taken at once.
  auto again = torch::zeros({3, 4});
  auto work = job.ranks[1]->recv(again, 0, 6);
  auto source = sent.clone();
  auto sendWork = job.ranks[0]->send(source, 1, 6);
  source.fill_(-1);
  job.ranks[0]->waitFor(sendWork, "sending");
  job.ranks[1]->waitFor(work, "receiving");
  CHECK(torch::equal(again, sent));
}

TEST_CASE("staged point-to-point: an interrupted receive writes nothing", "[comm]") {
  TwoRanks job;
  auto target = torch::zeros({8});
  auto work = job.ranks[1]->recv(target, 0, 9);  // rank 0 never sends
  std::thread interrupter([&] {
    std::this_thread::sleep_for(100ms);
    job.ranks[1]->interrupt("test");
  });
  CHECK_THROWS_AS(job.ranks[1]->waitFor(work, "receiving"), PeerLostError);
  interrupter.join();
  CHECK(target.abs().sum().item<double>() == 0.0);
  job.ranks[0]->abandon();
  job.ranks[1]->abandon();
}
