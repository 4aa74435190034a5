// SplitBackward: the input-gradient half (B) and the weight-gradient half (W)
// of a piece's backward add up to the whole backward, exactly, and W does not
// go through the input's path again.

#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>

#include "pipeline/split_backward.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

using namespace varuna;

namespace {

using Forward = std::function<torch::Tensor(const torch::Tensor&)>;

struct Grads {
  torch::Tensor input;
  std::vector<torch::Tensor> params;
};

std::vector<torch::Tensor> paramsOf(torch::nn::Module& m) { return m.parameters(/*recurse=*/true); }

void zeroGrads(const std::vector<torch::Tensor>& params) {
  for (auto p : params) p.mutable_grad() = torch::Tensor();
}

Grads collect(const torch::Tensor& input, const std::vector<torch::Tensor>& params) {
  Grads g;
  if (input.defined() && input.grad().defined()) g.input = input.grad().clone();
  for (const auto& p : params) g.params.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return g;
}

torch::Tensor leaf(const torch::Tensor& x) { return x.detach().clone().requires_grad_(true); }

// The whole backward of `micro` micro-batches, one after another.
Grads wholeBackward(const Forward& f, const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& xs) {
  zeroGrads(params);
  torch::Tensor lastInput;
  for (const auto& x : xs) {
    lastInput = x.defined() ? leaf(x) : torch::Tensor();
    auto out = f(lastInput);
    torch::autograd::backward({out}, {torch::ones_like(out)});
  }
  return collect(lastInput, params);
}

void checkEqual(const Grads& got, const Grads& want) {
  REQUIRE(got.params.size() == want.params.size());
  for (size_t i = 0; i < want.params.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(got.params[i].defined() == want.params[i].defined());
    if (want.params[i].defined()) CHECK(torch::allclose(got.params[i], want.params[i], 1e-6, 1e-7));
  }
  REQUIRE(got.input.defined() == want.input.defined());
  if (want.input.defined()) CHECK(torch::allclose(got.input, want.input, 1e-6, 1e-7));
}

// B of every micro-batch first, then every W: the order the schedule's tail has.
Grads splitBackward(const Forward& f, const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& xs,
                    SplitBackward::Mode expected) {
  zeroGrads(params);
  std::vector<std::unique_ptr<SplitBackward>> splits;
  torch::Tensor lastInput;
  for (const auto& x : xs) {
    lastInput = x.defined() ? leaf(x) : torch::Tensor();
    auto out = f(lastInput);
    splits.push_back(std::make_unique<SplitBackward>(out, torch::ones_like(out), lastInput, params));
    CHECK(splits.back()->mode() == expected);
    splits.back()->inputGradient();
  }
  if (expected == SplitBackward::Mode::kSplit) {
    for (const auto& p : params) CHECK_FALSE(p.grad().defined());  // B computed no weight gradient
  }
  const Grads afterB = collect(lastInput, params);
  for (auto& s : splits) s->weightGradient();
  Grads g = collect(lastInput, params);
  if (afterB.input.defined()) CHECK(torch::equal(g.input, afterB.input));  // W left the input's gradient alone
  return g;
}

std::vector<torch::Tensor> twoMicrobatches(int64_t features) {
  torch::manual_seed(7);
  return {torch::randn({4, features}), torch::randn({4, features})};
}

// Counts the runs of one node of the graph.
struct CountRuns : torch::autograd::FunctionPreHook {
  explicit CountRuns(int* n) : n_(n) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    ++*n_;
    return grads;
  }
  int* n_;
};

}  // namespace

TEST_CASE("a split backward of an MLP equals the whole backward, over two micro-batches", "[split_backward]") {
  torch::manual_seed(1);
  torch::nn::Sequential mlp(torch::nn::Linear(6, 8), torch::nn::GELU(), torch::nn::Linear(8, 6),
                            torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})));
  const Forward f = [&](const torch::Tensor& x) { return mlp->forward(x).pow(2).sum(); };
  const auto xs = twoMicrobatches(6);
  checkEqual(splitBackward(f, paramsOf(*mlp), xs, SplitBackward::Mode::kSplit), wholeBackward(f, paramsOf(*mlp), xs));
}

TEST_CASE("W never runs the input's path again", "[split_backward]") {
  torch::manual_seed(2);
  torch::nn::Linear a(5, 5), b(5, 5);
  auto x = leaf(torch::randn({3, 5}));
  auto hidden = torch::tanh(a(x));  // TanhBackward: on the input's path only
  auto out = b(hidden).sum();
  int runs = 0;
  hidden.grad_fn()->add_pre_hook(std::make_unique<CountRuns>(&runs));
  std::vector<torch::Tensor> params = paramsOf(*a);
  for (const auto& p : paramsOf(*b)) params.push_back(p);
  SplitBackward split(out, torch::ones_like(out), x, params);
  REQUIRE(split.mode() == SplitBackward::Mode::kSplit);
  split.inputGradient();
  CHECK(runs == 1);
  split.weightGradient();
  CHECK(runs == 1);
  for (const auto& p : params) CHECK(p.grad().defined());
}

TEST_CASE("B releases what only it needed: W holds just what it reads", "[split_backward]") {
  torch::manual_seed(8);
  torch::nn::Linear a(5, 7), b(7, 5);
  auto x = leaf(torch::randn({3, 5}));
  auto pre = a(x);  // saved by GeluBackward alone (b saves the GELU's output)
  const c10::weak_intrusive_ptr<c10::StorageImpl> preStorage(pre.storage().getWeakStorageImpl());
  auto hidden = torch::gelu(pre);
  pre = torch::Tensor();
  auto out = b(hidden).sum();
  hidden = torch::Tensor();
  std::vector<torch::Tensor> params = paramsOf(*a);
  for (const auto& p : paramsOf(*b)) params.push_back(p);
  SplitBackward split(out, torch::ones_like(out), x, params);
  REQUIRE(split.mode() == SplitBackward::Mode::kSplit);
  CHECK_FALSE(preStorage.expired());
  split.inputGradient();
  CHECK(preStorage.expired());  // as a whole backward would have freed it by now
  split.weightGradient();       // and W did not need it
  for (const auto& p : params) CHECK(p.grad().defined());
}

TEST_CASE("batch norm's weight and bias split off exactly", "[split_backward]") {
  torch::manual_seed(3);
  torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4));
  const auto xs = twoMicrobatches(4);
  // Training-mode batch norm changes running statistics: the same start for both runs.
  auto state = [&] {
    std::vector<torch::Tensor> copies;
    for (const auto& b : net->buffers()) copies.push_back(b.clone());
    return copies;
  };
  const auto start = state();
  auto restore = [&] {
    torch::NoGradGuard g;
    auto bufs = net->buffers();
    for (size_t i = 0; i < bufs.size(); ++i) bufs[i].copy_(start[i]);
  };
  const Forward f = [&](const torch::Tensor& x) { return net->forward(x).pow(2).sum(); };
  const Grads whole = wholeBackward(f, paramsOf(*net), xs);
  restore();
  checkEqual(splitBackward(f, paramsOf(*net), xs, SplitBackward::Mode::kSplit), whole);
}

TEST_CASE("a weight used twice along the path runs whole in B, exactly", "[split_backward]") {
  torch::manual_seed(4);
  torch::nn::Linear shared(5, 5);
  const Forward f = [&](const torch::Tensor& x) { return shared(torch::relu(shared(x))).sum(); };
  const auto xs = twoMicrobatches(5);
  checkEqual(splitBackward(f, paramsOf(*shared), xs, SplitBackward::Mode::kAllInB),
             wholeBackward(f, paramsOf(*shared), xs));
}

TEST_CASE("a piece without an input does its whole backward in W", "[split_backward]") {
  torch::manual_seed(5);
  torch::nn::Embedding embed(10, 4);
  const auto ids = torch::tensor({1, 3, 3, 7});
  const Forward f = [&](const torch::Tensor&) { return embed(ids).pow(2).sum(); };
  const std::vector<torch::Tensor> none{torch::Tensor(), torch::Tensor()};
  checkEqual(splitBackward(f, paramsOf(*embed), none, SplitBackward::Mode::kAllInW),
             wholeBackward(f, paramsOf(*embed), none));
}

TEST_CASE("an output that ignores the input, a stray leaf, a hooked gradient: whole in B, exactly",
          "[split_backward]") {
  torch::manual_seed(6);
  auto bias = torch::randn({5}).requires_grad_(true);
  auto scale = torch::randn({5}).requires_grad_(true);
  const auto xs = twoMicrobatches(5);
  const Forward independent = [&](const torch::Tensor&) { return (bias * 2).sum(); };
  checkEqual(splitBackward(independent, {bias}, xs, SplitBackward::Mode::kAllInB), wholeBackward(independent, {bias}, xs));
  // A parameter-only term added to an input term splits: both branch off at the sum.
  const Forward mixed = [&](const torch::Tensor& x) { return (x * scale + bias * 2).sum(); };
  checkEqual(splitBackward(mixed, {scale, bias}, xs, SplitBackward::Mode::kSplit),
             wholeBackward(mixed, {scale, bias}, xs));
  // `bias` is used but not passed as one of the piece's parameters: it still gets its gradient.
  zeroGrads({bias});
  splitBackward(mixed, {scale}, {xs[0]}, SplitBackward::Mode::kAllInB);
  REQUIRE(bias.grad().defined());
  const auto strayGrad = bias.grad().clone();
  zeroGrads({bias});
  wholeBackward(mixed, {scale}, {xs[0]});
  CHECK(torch::allclose(strayGrad, bias.grad()));
  // A hook on a gradient at a branch point would run twice.
  int hookRuns = 0;
  const Forward hooked = [&](const torch::Tensor& x) {
    auto product = x * scale;
    product.register_hook([&hookRuns](torch::Tensor g) {
      ++hookRuns;
      return g;
    });
    return product.sum();
  };
  checkEqual(splitBackward(hooked, {scale}, {xs[0]}, SplitBackward::Mode::kAllInB), wholeBackward(hooked, {scale}, {xs[0]}));
  CHECK(hookRuns == 2);  // once per run above, never twice in one
}

TEST_CASE("a group with two roots: a weight feeding two parallel branches of the path", "[split_backward]") {
  torch::manual_seed(8);
  torch::nn::Linear shared(4, 4);
  // Two parallel uses of one weight (neither below the other on the path): one group, two roots.
  const Forward f = [&](const torch::Tensor& x) { return (shared(x) * shared(x.flip({1}))).sum(); };
  const auto xs = twoMicrobatches(4);
  checkEqual(splitBackward(f, paramsOf(*shared), xs, SplitBackward::Mode::kSplit), wholeBackward(f, paramsOf(*shared), xs));
}
