#include "gpt_model.h"

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/init.h>

#include "varuna/common/errors.h"

namespace gpt {
namespace {

using varuna::Batch;
using varuna::Piece;

// GPT-2 initialisation: N(0, 0.02) weights, zero biases.
void initLinear(torch::nn::Linear& layer) {
  torch::NoGradGuard noGrad;
  torch::nn::init::normal_(layer->weight, 0.0, 0.02);
  if (layer->bias.defined()) layer->bias.zero_();
}

class EmbeddingPiece : public Piece {
 public:
  explicit EmbeddingPiece(const GptConfig& c)
      : wte_(register_module("wte", torch::nn::Embedding(c.vocabSize, c.dModel))),
        wpe_(register_module("wpe", torch::nn::Embedding(c.seqLen, c.dModel))),
        dropout_(register_module("dropout", torch::nn::Dropout(c.dropout))) {
    torch::NoGradGuard noGrad;
    torch::nn::init::normal_(wte_->weight, 0.0, 0.02);
    torch::nn::init::normal_(wpe_->weight, 0.0, 0.02);
  }
  torch::Tensor forward(const torch::Tensor&, const Batch& batch) override {
    const auto& tokens = batch.at("tokens");
    auto positions = torch::arange(tokens.size(1), tokens.options());
    return dropout_(wte_(tokens) + wpe_(positions));
  }

 private:
  torch::nn::Embedding wte_, wpe_;
  torch::nn::Dropout dropout_;
};

class BlockPiece : public Piece {
 public:
  explicit BlockPiece(const GptConfig& c)
      : heads_(c.heads), dropout_(c.dropout),
        ln1_(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dModel})))),
        qkv_(register_module("qkv", torch::nn::Linear(c.dModel, 3 * c.dModel))),
        proj_(register_module("proj", torch::nn::Linear(c.dModel, c.dModel))),
        ln2_(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dModel})))),
        fc_(register_module("fc", torch::nn::Linear(c.dModel, 4 * c.dModel))),
        fc2_(register_module("fc2", torch::nn::Linear(4 * c.dModel, c.dModel))),
        residDropout_(register_module("dropout", torch::nn::Dropout(c.dropout))) {
    for (auto* layer : {&qkv_, &proj_, &fc_, &fc2_}) initLinear(*layer);
    // Registered last and only when asked for, so the other parameters keep
    // their names and initial values (the seeded draws above come first).
    if (c.batchNorm) bn_ = register_module("bn", torch::nn::BatchNorm1d(c.dModel));
  }
  torch::Tensor forward(const torch::Tensor& input, const Batch&) override {
    const int64_t b = input.size(0), t = input.size(1), d = input.size(2), hd = d / heads_;
    // BatchNorm1d over (N, C): every position of every sample is one row.
    const torch::Tensor x = bn_ ? bn_(input.reshape({b * t, d})).view({b, t, d}) : input;
    auto qkv = qkv_(ln1_(x)).split(d, 2);
    auto heads = [&](const torch::Tensor& y) { return y.view({b, t, heads_, hd}).transpose(1, 2); };
    auto attn = at::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), {},
                                                 is_training() ? dropout_ : 0.0, /*is_causal=*/true);
    auto h = x + residDropout_(proj_(attn.transpose(1, 2).reshape({b, t, d})));
    return h + residDropout_(fc2_(torch::gelu(fc_(ln2_(h)))));
  }

 private:
  int64_t heads_;
  double dropout_;
  torch::nn::LayerNorm ln1_;
  torch::nn::Linear qkv_, proj_;
  torch::nn::LayerNorm ln2_;
  torch::nn::Linear fc_, fc2_;
  torch::nn::Dropout residDropout_;
  torch::nn::BatchNorm1d bn_{nullptr};
};

class HeadPiece : public Piece {
 public:
  explicit HeadPiece(const GptConfig& c)
      : vocab_(c.vocabSize),
        lnf_(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dModel})))),
        lmHead_(register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.dModel, c.vocabSize).bias(false)))) {
    initLinear(lmHead_);
  }
  torch::Tensor forward(const torch::Tensor& x, const Batch& batch) override {
    auto logits = lmHead_(lnf_(x));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, vocab_}), batch.at("targets").reshape({-1}));
  }

 private:
  int64_t vocab_;
  torch::nn::LayerNorm lnf_;
  torch::nn::Linear lmHead_;
};

}  // namespace

varuna::ModelSpec makeGptModel(const GptConfig& c) {
  if (c.dModel % c.heads != 0) {
    throw varuna::ConfigError(varuna::strCat("d_model ", c.dModel, " is not divisible by heads ", c.heads));
  }
  const int64_t d = c.dModel;
  varuna::ModelSpec spec;
  spec.seed = c.seed;
  spec.pieces.push_back({"embed", [c] { return std::make_shared<EmbeddingPiece>(c); }, (c.vocabSize + c.seqLen) * d});
  // Two LayerNorms, qkv, proj, fc, fc2 (+ the BatchNorm's weight and bias;
  // its running statistics are buffers, not parameters).
  const int64_t blockParams = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) +
                              (c.batchNorm ? 2 * d : 0);
  for (int64_t i = 0; i < c.layers; ++i) {
    spec.pieces.push_back({"block" + std::to_string(i), [c] { return std::make_shared<BlockPiece>(c); }, blockParams});
  }
  spec.pieces.push_back({"head", [c] { return std::make_shared<HeadPiece>(c); }, 2 * d + c.vocabSize * d});
  if (c.tieEmbeddings && c.tieHeadFirst) spec.sharedWeights.push_back({"head.lm_head.weight", "embed.wte.weight"});
  if (c.tieEmbeddings && !c.tieHeadFirst) spec.sharedWeights.push_back({"embed.wte.weight", "head.lm_head.weight"});
  return spec;
}

}  // namespace gpt
