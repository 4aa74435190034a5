// GradBuckets: this stage's gradients, stored as views into flat buckets so a
// bucket is all-reduced in place, as one message, the moment its gradients are
// final (during the step's last backward), overlapping the rest of the backward.
//
// Owned by Varuna::Impl, used from the training thread; the all-reduces run on
// c10d's threads. Gradients accumulate across micro-batches in the buckets, so
// nothing else may replace param.grad() (never call optimizer.zero_grad()).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/types.h>

#include <set>
#include <string>
#include <vector>

namespace varuna {

class Communicator;

struct BucketedParam {
  torch::Tensor param;
  int piece;                // local piece index whose backward finalises this gradient
  bool countInNorm = true;  // false: another rank counts it in the global norm
};

class GradBuckets {
 public:
  // Adds params reduced (summed) over `group` (null: nothing to reduce). Give
  // them in the order their gradients become final (last piece first); every
  // member of the group must add the same sizes in the same order.
  void add(const std::vector<BucketedParam>& params, c10::intrusive_ptr<c10d::Backend> group, int64_t bucketBytes);

  // A piece's backward for the step's last micro-batch is done: launch every
  // bucket that now has only final gradients.
  void markPieceDone(int piece);
  // Launches whatever is left and waits for every reduction.
  void finish(Communicator& comm);

  void zero();
  // Over the buckets counted in the norm: a float64 scalar on the gradients'
  // device (no synchronisation).
  torch::Tensor sumOfSquaresOnDevice() const;
  void scale(double factor);
  void scale(const torch::Tensor& factor);  // a scalar tensor, e.g. on the device

 private:
  struct Bucket {
    torch::Tensor flat;
    std::set<int> pieces;   // pieces whose gradients live here
    std::set<int> pending;  // not yet final this step
    c10::intrusive_ptr<c10d::Backend> group;
    c10::intrusive_ptr<c10d::Work> work;
    std::vector<torch::Tensor> counted;  // gradient views counted in the norm (all: {flat})
  };
  void launch(Bucket& bucket);
  void seal(std::vector<BucketedParam>& params, const c10::intrusive_ptr<c10d::Backend>& group);

  std::vector<Bucket> buckets_;
};

}  // namespace varuna
