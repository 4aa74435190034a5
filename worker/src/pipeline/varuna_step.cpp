// Running the pipeline: the shapes crossing each cut, learned once; step()
// over the schedule (forwards, recomputes, backwards, or their B and W
// halves, on every chunk this rank holds), the exchange that ends it; and
// evaluate(). The Impl these share with varuna.cpp is in varuna_impl.h.
//
// Chunks: under interleaved and zbv a rank holds several virtual stages of
// the model (ChunkLayout). Chunk c receives from the rank of virtual stage
// virtualStage(c) - 1 and sends to that of virtualStage(c) + 1; where that is
// this rank (zbv's turn at the bottom of the V, or one rank holding every
// chunk), the tensor is handed from chunk to chunk without a message.
#include <torch/autograd.h>

#include <chrono>
#include <functional>
#include <limits>

#include "device/autocast_scope.h"
#include "pipeline/varuna_impl.h"
#include "varuna/common/errors.h"

namespace varuna {

namespace {

constexpr int kHeaderLength = 10;  // dtype, ndim, up to 8 dims

torch::Tensor encodeShape(const torch::Tensor& t) {
  VARUNA_CHECK(t.dim() <= kHeaderLength - 2, "activation with ", t.dim(), " dims");
  auto header = torch::zeros({kHeaderLength}, torch::kLong);
  auto h = header.accessor<int64_t, 1>();
  h[0] = static_cast<int64_t>(t.scalar_type());
  h[1] = t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) h[2 + d] = t.size(d);
  return header;
}

CutShape decodeShape(const torch::Tensor& header) {
  auto h = header.accessor<int64_t, 1>();
  CutShape shape;
  shape.dtype = static_cast<at::ScalarType>(h[0]);
  for (int64_t d = 1; d < h[1]; ++d) shape.trailing.push_back(h[2 + d]);
  shape.known = true;
  return shape;
}

}  // namespace

void Varuna::Impl::checkMessageLimits(int microbatches) const {
  if (layout_.virtualStages() > (1 << kCutBits)) {
    throw ConfigError(strCat(layout_.virtualStages(), " virtual stages (stages x chunks) exceed the ", 1 << kCutBits,
                             " a step's messages can name: use fewer stages or chunks"));
  }
  if (microbatches > (1 << kMicrobatchBits)) {
    throw ConfigError(strCat(microbatches, " micro-batches in a step exceed the ", 1 << kMicrobatchBits,
                             " its messages can name: use a larger micro-batch size (chunk_size)"));
  }
}

torch::Tensor Varuna::Impl::runForward(MicrobatchState& state, const torch::Tensor& input, const Batch& batch,
                                       bool keep) {
  AutocastScope autocast(opt_.precision != Precision::kFp32, opt_.device.type(), autocastType(opt_.precision));
  return model_->forward(state, input, batch, batch.begin()->second.size(0), keep, last(state.chunk));
}

void Varuna::Impl::learnCutShapes() {
  // One sample micro-batch flows through the pipeline once, so every stage
  // learns the shape and dtype arriving at and leaving its cuts; steps then
  // post their receives ahead of time without any per-message header. Each
  // rank runs its chunks in the model's order, so the flow never waits on
  // itself.
  torch::NoGradGuard noGrad;
  auto gen = at::globalContext().defaultGenerator(opt_.device);
  torch::Tensor rng;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng = gen.get_state();
  }
  Batch sample = opt_.getBatch(opt_.chunkSize, opt_.device);
  auto micro = splitMicrobatches(sample, opt_.chunkSize, "getBatch(chunk_size)");
  const int chunks = numChunks();
  inShape_.assign(chunks, CutShape{});
  outShape_.assign(chunks, CutShape{});
  auto flowThroughChunks = [&] {
    torch::Tensor carried;  // the previous chunk's output, where it stays on this rank
    for (int c = 0; c < chunks; ++c) {
      torch::Tensor input;
      if (inFromChunkBefore(c)) {
        inShape_[c] = outShape_[c - 1];
        input = carried;
      } else if (!first(c)) {
        const int cut = virtualStage(c) - 1;
        // On the device: NCCL carries device tensors only (Gloo stages them).
        auto header = torch::zeros({kHeaderLength}, torch::TensorOptions().dtype(torch::kLong).device(opt_.device));
        comm_->waitFor(comm_->recv(header, prevRank(c), tagFor(kShapeTag, cut, 0)), "learning activation shapes");
        inShape_[c] = decodeShape(header.cpu());
        input = torch::empty(inShape_[c].withBatch(opt_.chunkSize),
                             torch::TensorOptions().dtype(inShape_[c].dtype).device(opt_.device));
        comm_->waitFor(comm_->recv(input, prevRank(c), tagFor(kShapeTag, cut, 1)), "learning activation shapes");
      }
      MicrobatchState state;
      state.chunk = c;
      torch::Tensor out = runForward(state, input, micro[0], /*keep=*/true);
      if (last(c)) continue;
      out = out.contiguous();
      auto header = encodeShape(out);
      outShape_[c] = decodeShape(header);
      if (outToChunkAfter(c)) {
        carried = out.detach();
        continue;
      }
      const int cut = virtualStage(c);
      header = header.to(opt_.device);
      comm_->waitFor(comm_->send(header, nextRank(c), tagFor(kShapeTag, cut, 0)), "learning activation shapes");
      comm_->waitFor(comm_->send(out, nextRank(c), tagFor(kShapeTag, cut, 1)), "learning activation shapes");
    }
  };
  // The sample forward must not count as training: every buffer is put back,
  // and those it changed (running statistics) are remembered.
  model_->learnChangingBuffers(flowThroughChunks);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(rng);
}

std::vector<Batch> Varuna::Impl::splitMicrobatches(const Batch& inputs, int64_t expected, const char* what) const {
  if (inputs.empty()) throw ConfigError(strCat(what, ": the input batch has no tensors"));
  for (const auto& [key, t] : inputs) {
    if (!t.defined() || t.dim() < 1 || t.size(0) != expected) {
      throw ConfigError(strCat(what, ": input '", key, "' must be batch-major with ", expected,
                               " samples along dimension 0, got ", t.defined() ? t.sizes() : at::IntArrayRef{}));
    }
  }
  const int64_t m = (expected + opt_.chunkSize - 1) / opt_.chunkSize;
  std::vector<Batch> micro(m);
  for (const auto& [key, t] : inputs) {
    auto onDevice = t.device() == opt_.device ? t : t.to(opt_.device);
    auto chunks = onDevice.split(opt_.chunkSize, 0);
    for (int64_t i = 0; i < m; ++i) micro[i][key] = chunks[i];
  }
  return micro;
}

const StageSchedule& Varuna::Impl::scheduleFor(int microbatches) {
  auto it = schedules_.find(microbatches);
  if (it == schedules_.end()) {
    checkMessageLimits(microbatches);
    it = schedules_.emplace(microbatches, generateSchedule(opt_.schedule, P_, microbatches, numChunks())).first;
  }
  return it->second[stage_];
}

bool Varuna::Impl::postsReceivesFirst() const {
  // On the CPU with Gloo's tag matching, every receive is posted at the
  // start (receivesFirst: why, and what it costs). With CUDA tensors,
  // Gloo's receives land in pinned host buffers: those keep to the plan's
  // order, which allocates them as they come; NCCL needs that order.
  return comm_->matchesByTag() && opt_.device.is_cpu();
}

StageMessagePlan Varuna::Impl::forThisTransport(StageMessagePlan plan) const {
  if (postsReceivesFirst()) return receivesFirst(std::move(plan));
  return plan;
}

const StageMessagePlan& Varuna::Impl::stepPlanFor(int microbatches) {
  auto it = stepPlans_.find(microbatches);
  if (it == stepPlans_.end()) {
    scheduleFor(microbatches);
    auto plans = planStepMessages(schedules_.at(microbatches), layout_);
    it = stepPlans_.emplace(microbatches, forThisTransport(std::move(plans[stage_]))).first;
  }
  return it->second;
}

std::pair<const StageSchedule&, const StageMessagePlan&> Varuna::Impl::evalPlanFor(int microbatches) {
  auto it = evalPlans_.find(microbatches);
  if (it == evalPlans_.end()) {
    checkMessageLimits(microbatches);
    const Schedule order = evaluationOrder(layout_, microbatches);
    auto plans = planStepMessages(order, layout_);
    evalOrders_[microbatches] = order[stage_];
    it = evalPlans_.emplace(microbatches, forThisTransport(std::move(plans[stage_]))).first;
  }
  return {evalOrders_.at(microbatches), it->second};
}

StepTraffic::Setup Varuna::Impl::trafficSetup(const std::vector<Batch>& micro, TagKind activationTag) {
  StepTraffic::Setup setup;
  setup.comm = comm_.get();
  setup.layout = layout_;
  setup.stage = stage_;
  setup.rankOf = [this](int stage) { return map_.rankOf(stage, replica_); };
  setup.inShape = &inShape_;
  setup.outShape = &outShape_;
  setup.device = opt_.device;
  for (const auto& batch : micro) setup.microbatchSizes.push_back(batch.begin()->second.size(0));
  setup.activationTag = activationTag;
  return setup;
}

void Varuna::Impl::checkOutgoing(const torch::Tensor& out, int64_t b, int chunk) const {
  const CutShape& shape = outShape_[chunk];
  const auto expected = shape.withBatch(b);
  if (!out.sizes().equals(expected) || out.scalar_type() != shape.dtype) {
    throw ConfigError(strCat("stage ", stage_, numChunks() > 1 ? strCat(" chunk ", chunk) : "",
                             " produced an activation of shape ", out.sizes(), " ", out.scalar_type(), " but ",
                             at::IntArrayRef(expected), " ", shape.dtype,
                             " was learned from getBatch(); the dimensions after the batch must not change"));
  }
}

StepResult Varuna::Impl::step(const Batch& inputs, std::optional<double> clip) {
  if (!optimizer_) throw ConfigError("call setOptimizer() before step()");
  if (clip && !(*clip > 0)) throw ConfigError(strCat("clip_grad_max_norm must be > 0, got ", *clip));
  const auto micro = splitMicrobatches(inputs, localBatch(), "step()");
  const int m = static_cast<int>(micro.size());
  const StageSchedule& tasks = scheduleFor(m);
  const double scale = scaler_.scale();
  salvageState_->stepStarted();
  buckets_.zero();

  const int chunks = numChunks();
  std::vector<std::vector<MicrobatchState>> states(chunks);
  for (int c = 0; c < chunks; ++c) {
    states[c].resize(m);
    for (auto& state : states[c]) state.chunk = c;
  }
  auto bsize = [&](int i) { return micro[i].begin()->second.size(0); };
  // Receives are posted and sends started where the plan says: the same
  // order on both ends of every pair of ranks (NCCL's matching).
  const StageMessagePlan& plan = stepPlanFor(m);
  StepTraffic traffic(trafficSetup(micro, kActivationTag));
  // Per chunk, the task that finalises its gradients: the buckets hear of it.
  std::vector<int> finalBackward(chunks, -1);
  for (int k = 0; k < static_cast<int>(tasks.size()); ++k) {
    if (tasks[k].type == TaskType::kBackward || tasks[k].type == TaskType::kBackwardWeight) {
      finalBackward[tasks[k].chunk] = k;
    }
  }
  torch::Tensor lossSum = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(opt_.device));
  const std::function<void(int)> onPieceDone = [this](int piece) { buckets_.markPieceDone(piece); };
  const std::function<void(int)> noCallback;

  using Clock = std::chrono::steady_clock;
  Clock::duration computeTime{};
  StepTimeline& timeline = *timeline_;
  timeline.beginStep(stepsDone_ + 1, Clock::now());
  for (int k = 0; k < static_cast<int>(tasks.size()); ++k) {
    const Task& task = tasks[k];
    const int i = task.microbatch, c = task.chunk;
    MicrobatchState& state = states[c][i];
    const auto postStart = Clock::now();
    traffic.issue(plan.beforeTask[k]);
    const auto waitStart = Clock::now();
    if (!plan.beforeTask[k].empty()) timeline.span("messages", "post", postStart, waitStart);
    // Waits for inputs are outside the timed region: only compute counts.
    torch::Tensor input;
    if (task.type == TaskType::kForward && !first(c)) input = traffic.takeActivation(c, i);
    const bool inputGradient = task.type == TaskType::kBackward || task.type == TaskType::kBackwardInput;
    torch::Tensor grad;
    if (inputGradient && !last(c)) grad = traffic.takeGradient(c, i);
    const auto& pieceDone = k == finalBackward[c] ? onPieceDone : noCallback;
    const auto taskStart = Clock::now();
    if (input.defined() || grad.defined()) {
      timeline.span("wait", input.defined() ? "wait activation" : "wait gradient", waitStart, taskStart);
    }
    torch::Tensor produced;  // what goes to another rank, if the plan sends it
    switch (task.type) {
      case TaskType::kForward: {
        torch::Tensor out = runForward(state, input, micro[i], task.keepActivations);
        if (last(c)) {
          lossSum += out.detach().to(torch::kDouble) * static_cast<double>(bsize(i));
          break;
        }
        checkOutgoing(out, bsize(i), c);
        auto payload = out.detach().contiguous();
        if (outToChunkAfter(c)) {
          traffic.handActivation(c + 1, i, payload);
        } else {
          produced = payload;
        }
        break;
      }
      case TaskType::kRecompute: {
        AutocastScope autocast(opt_.precision != Precision::kFp32, opt_.device.type(), autocastType(opt_.precision));
        model_->recompute(state, micro[i], bsize(i), last(c));
        break;
      }
      case TaskType::kBackward:
      case TaskType::kBackwardInput: {
        if (last(c)) {
          // d(global mean loss)/d(micro-batch mean loss) = b_i / B, times the fp16 scale.
          const double weight = scale * static_cast<double>(bsize(i)) / static_cast<double>(opt_.batchSize);
          grad = torch::full_like(state.outputs.back(), weight);
        }
        const bool whole = task.type == TaskType::kBackward;
        torch::Tensor gradInput = whole ? model_->backward(state, grad, pieceDone) : model_->backwardInput(state, grad);
        if (inFromChunkBefore(c)) {
          traffic.handGradient(c - 1, i, gradInput);
        } else if (!first(c)) {
          produced = gradInput.contiguous();
        }
        if (whole) state = MicrobatchState{.chunk = c};
        break;
      }
      case TaskType::kBackwardWeight:
        model_->backwardWeight(state, pieceDone);
        state = MicrobatchState{.chunk = c};
        break;
    }
    const auto taskEnd = Clock::now();
    computeTime += taskEnd - taskStart;
    timeline.task(task, taskStart, taskEnd);
    traffic.issue(plan.afterTask[k], produced);
    if (!plan.afterTask[k].empty()) timeline.span("messages", "post", taskEnd, Clock::now());
  }
  const auto drainStart = Clock::now();
  traffic.finishSends();
  const auto bucketsStart = Clock::now();
  timeline.span("wait", "finish sends", drainStart, bucketsStart);
  buckets_.finish(*comm_);
  const auto exchangeStart = Clock::now();
  timeline.span("allreduce", "gradient buckets", bucketsStart, exchangeStart);

  if (opt_.faults.poisonGradients &&
      opt_.faults.poisonGradients({stage_, replica_, stepsDone_ + 1, opt_.manager.generation})) {
    buckets_.scale(std::numeric_limits<double>::infinity());
  }
  // The one job-wide exchange of a step: loss, and the squared gradient norm
  // that yields clipping and the fp16 overflow verdict identically everywhere.
  const PendingUpdate pending{scale, clip, m, std::chrono::duration<double>(computeTime).count(),
                              traffic.waitedSeconds()};
  salvageState_->exchangeStarted(pending);
  auto summed = StepExchange::share(lossSum, buckets_.sumOfSquaresOnDevice(), checkpointSignalled());
  if (map_.worldSize() > 1) {
    std::vector<at::Tensor> tensors{summed};
    comm_->waitFor(comm_->world()->allreduce(tensors), "all-reducing the step's loss and gradient norm");
  }
  if (opt_.faults.loseExchange && opt_.faults.loseExchange({stage_, replica_, stepsDone_ + 1, opt_.manager.generation})) {
    throw PeerLostError("fault injected: this rank's exchange 'failed'", -1);
  }
  const auto updateStart = Clock::now();
  timeline.span("allreduce", "step exchange", exchangeStart, updateStart);
  StepResult result = opt_.onNonFiniteGradients == NonFiniteGradients::kStopTraining
                          ? queueUpdateThenRead(summed, pending)
                          : applyStep(StepExchange::fromTensor(summed), pending);
  timeline.span("update", "update", updateStart, Clock::now());
  // This step carries the request (a SIGUSR1 meanwhile asks for the same).
  if (result.checkpointRequested) clearCheckpointSignal();
  synchroniseReplicaBuffers();
  salvageState_->stepFinished();
  timeline.endStep(Clock::now());
  return result;
}

double Varuna::Impl::evaluate(const Batch& inputs) {
  const int64_t samples = inputs.empty() ? 0 : inputs.begin()->second.size(0);
  const auto micro = splitMicrobatches(inputs, samples, "evaluate()");
  checkMessageLimits(static_cast<int>(micro.size()));
  torch::NoGradGuard noGrad;
  model_->eval();
  struct TrainModeOnExit {  // back to training mode even when a peer fails
    StageModel& model;
    ~TrainModeOnExit() { model.train(); }
  } restore{*model_};
  double lossSum = 0.0;
  // Chunk by chunk, every micro-batch (evaluationOrder), the messages where
  // the plan puts them: the stages overlap as in a step.
  const int m = static_cast<int>(micro.size());
  const auto [order, plan] = evalPlanFor(m);
  StepTraffic traffic(trafficSetup(micro, kEvalTag));
  for (int k = 0; k < static_cast<int>(order.size()); ++k) {
    const int i = order[k].microbatch, c = order[k].chunk;
    const int64_t b = micro[i].begin()->second.size(0);
    traffic.issue(plan.beforeTask[k]);
    torch::Tensor input;
    if (!first(c)) input = traffic.takeActivation(c, i);
    MicrobatchState state;
    state.chunk = c;
    torch::Tensor out = runForward(state, input, micro[i], /*keep=*/true);
    torch::Tensor produced;
    if (last(c)) {
      lossSum += out.item<double>() * static_cast<double>(b);
    } else {
      checkOutgoing(out, b, c);
      if (outToChunkAfter(c)) {
        traffic.handActivation(c + 1, i, out.contiguous());
      } else {
        produced = out.contiguous();
      }
    }
    traffic.issue(plan.afterTask[k], produced);
  }
  traffic.finishSends();
  const bool lossHere = holdsLoss();
  auto stats = torch::tensor({lossHere ? lossSum : 0.0, lossHere ? static_cast<double>(samples) : 0.0},
                             torch::TensorOptions().dtype(torch::kDouble));
  if (map_.worldSize() > 1) {
    stats = stats.to(opt_.device);
    std::vector<at::Tensor> tensors{stats};
    comm_->waitFor(comm_->world()->allreduce(tensors), "all-reducing the evaluation loss");
    stats = stats.cpu();
  }
  return stats[0].item<double>() / stats[1].item<double>();
}

}  // namespace varuna
