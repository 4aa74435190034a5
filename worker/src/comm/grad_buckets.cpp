#include "comm/grad_buckets.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>

#include "comm/comm.h"

namespace varuna {

void GradBuckets::add(const std::vector<BucketedParam>& params, c10::intrusive_ptr<c10d::Backend> group,
                      int64_t bucketBytes) {
  std::vector<BucketedParam> current;
  int64_t bytes = 0;
  for (const auto& p : params) {
    const bool typeChanges = !current.empty() && (current.back().param.scalar_type() != p.param.scalar_type() ||
                                                  current.back().param.device() != p.param.device());
    if (typeChanges || (!current.empty() && bytes >= bucketBytes)) {
      seal(current, group);
      bytes = 0;
    }
    current.push_back(p);
    bytes += p.param.numel() * static_cast<int64_t>(p.param.element_size());
  }
  if (!current.empty()) seal(current, group);
}

void GradBuckets::seal(std::vector<BucketedParam>& params, const c10::intrusive_ptr<c10d::Backend>& group) {
  int64_t total = 0;
  for (const auto& p : params) total += p.param.numel();
  Bucket bucket;
  bucket.flat = torch::zeros({total}, params.front().param.options().requires_grad(false));
  bucket.group = group;
  int64_t offset = 0;
  bool allCounted = true;
  for (auto& p : params) {
    const int64_t n = p.param.numel();
    // The gradient is a view into the bucket: autograd accumulates in place.
    p.param.mutable_grad() = bucket.flat.narrow(0, offset, n).view(p.param.sizes());
    if (p.countInNorm) bucket.counted.push_back(p.param.grad());
    allCounted = allCounted && p.countInNorm;
    offset += n;
    bucket.pieces.insert(p.piece);
  }
  if (allCounted) bucket.counted = {bucket.flat};  // one pass over the whole bucket
  buckets_.push_back(std::move(bucket));
  params.clear();
}

void GradBuckets::launch(Bucket& bucket) {
  if (bucket.work || !bucket.group) return;
  std::vector<at::Tensor> tensors{bucket.flat};
  bucket.work = bucket.group->allreduce(tensors);
}

void GradBuckets::markPieceDone(int piece) {
  for (auto& bucket : buckets_) {
    if (bucket.pending.erase(piece) && bucket.pending.empty()) launch(bucket);
  }
}

void GradBuckets::finish(Communicator& comm) {
  for (auto& bucket : buckets_) launch(bucket);
  for (auto& bucket : buckets_) {
    if (bucket.work) comm.waitFor(bucket.work, "all-reducing gradients");
    bucket.work.reset();
  }
}

void GradBuckets::zero() {
  for (auto& bucket : buckets_) {
    VARUNA_CHECK(!bucket.work, "zeroing a bucket whose all-reduce is in flight");
    bucket.flat.zero_();
    bucket.pending = bucket.pieces;
  }
}

namespace {

// A float32 gradient in host memory, in one pass and no temporaries: each
// square is exact in float64 (24-bit significands), summed in float64 in
// blocks of a fixed size, eight lanes a block (the compiler vectorises
// them), the blocks in parallel and their sums added in order. The same
// values give the same sum whatever the number of threads. At 3.5M
// elements this is 2 ms against 5 ms for square() then sum() chunk by
// chunk, the other path below (bench figures: docs/benchmarks.md).
double hostFloatSumOfSquares(const float* x, int64_t n) {
  constexpr int64_t kBlock = int64_t{1} << 16;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> sums(blocks);
  at::parallel_for(0, blocks, 1, [&](int64_t firstBlock, int64_t endBlock) {
    for (int64_t b = firstBlock; b < endBlock; ++b) {
      const float* p = x + b * kBlock;
      const int64_t len = std::min(kBlock, n - b * kBlock);
      std::array<double, 8> lanes{};
      int64_t i = 0;
      for (; i + 8 <= len; i += 8) {
        for (int j = 0; j < 8; ++j) lanes[j] += static_cast<double>(p[i + j]) * static_cast<double>(p[i + j]);
      }
      double sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
      for (; i < len; ++i) sum += static_cast<double>(p[i]) * static_cast<double>(p[i]);
      sums[b] = sum;
    }
  });
  double total = 0.0;
  for (const double s : sums) total += s;
  return total;
}

}  // namespace

torch::Tensor GradBuckets::sumOfSquaresOnDevice() const {
  // Summed in float64: a float32 norm of a whole bucket (millions of
  // elements) comes out low by up to 1e-4 relative as its accumulator
  // rounds, and clipping would scale by that error. A float32 gradient in
  // host memory takes hostFloatSumOfSquares. Otherwise the squares are taken
  // in float32 (exact for bf16 and fp16 gradients, within 1e-7 each for
  // fp32) and widened to float64 for the sum, chunk by chunk, so the only
  // temporaries are one chunk's squares and their float64 copy (12 bytes an
  // element). In host memory they count in the rank's peak resident memory
  // (4M-element chunks were 36 MB of a step's peak on a 64 MB stage: P12),
  // so chunks there are small; on a GPU the caching allocator keeps them and
  // large chunks save kernel launches. The sum stays on the gradients'
  // device: one read back at the end, not one per bucket.
  constexpr int64_t kDeviceNormChunk = int64_t{1} << 22;  // 48 MB of temporaries
  constexpr int64_t kHostNormChunk = int64_t{1} << 18;    // 3 MB of temporaries
  torch::Tensor total;
  double hostFloatTotal = 0.0;
  for (const auto& bucket : buckets_) {
    for (const auto& view : bucket.counted) {
      if (view.is_cpu() && view.scalar_type() == torch::kFloat && view.is_contiguous()) {
        hostFloatTotal += hostFloatSumOfSquares(view.const_data_ptr<float>(), view.numel());
        continue;
      }
      const auto flat = view.reshape({-1});
      const int64_t chunk = flat.is_cpu() ? kHostNormChunk : kDeviceNormChunk;
      for (int64_t first = 0; first < flat.numel(); first += chunk) {
        auto part = flat.narrow(0, first, std::min(chunk, flat.numel() - first));
        if (part.scalar_type() != torch::kDouble) part = part.to(torch::kFloat);
        const auto squares = at::sum(part.square(), torch::kDouble);
        total = total.defined() ? total.add_(squares) : squares;
      }
    }
  }
  if (total.defined()) return hostFloatTotal == 0.0 ? total : total.add_(hostFloatTotal);
  const auto device = buckets_.empty() ? torch::Device(torch::kCPU) : buckets_.front().flat.device();
  return torch::full({}, hostFloatTotal, torch::TensorOptions().dtype(torch::kDouble).device(device));
}

void GradBuckets::scale(double factor) {
  for (auto& bucket : buckets_) bucket.flat.mul_(factor);
}

void GradBuckets::scale(const torch::Tensor& factor) {
  for (auto& bucket : buckets_) bucket.flat.mul_(factor);
}

}  // namespace varuna
