#include "pipeline/split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <numeric>
#include <set>
#include <unordered_map>
#include <utility>

#include "varuna/common/errors.h"

namespace varuna {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

// What B leaves at one branch point for W: the gradients arriving there.
struct Kept {
  bool active = true;  // B is running; W's own run through the node is not kept
  variable_list grads;
};

class KeepGradients : public torch::autograd::FunctionPreHook {
 public:
  explicit KeepGradients(std::shared_ptr<Kept> kept) : kept_(std::move(kept)) {}
  variable_list operator()(const variable_list& grads) override {
    if (kept_->active) kept_->grads = grads;
    return grads;
  }

 private:
  std::shared_ptr<Kept> kept_;
};

// The piece's graph in post-order (every node after the nodes it leads to).
std::vector<Node*> postOrder(Node* root) {
  std::vector<Node*> order;
  std::set<Node*> seen{root};
  std::vector<std::pair<Node*, size_t>> stack{{root, 0}};
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    if (next < node->next_edges().size()) {
      Node* child = node->next_edges()[next++].function.get();
      if (child && seen.insert(child).second) stack.push_back({child, 0});
      continue;
    }
    order.push_back(node);
    stack.pop_back();
  }
  return order;
}

// Union-find over small integers.
struct Components {
  std::vector<int> parent;
  explicit Components(int n) : parent(n) { std::iota(parent.begin(), parent.end(), 0); }
  int find(int x) { return parent[x] == x ? x : parent[x] = find(parent[x]); }
  void join(int a, int b) { parent[find(a)] = find(b); }
};

}  // namespace

// What W needs: the branch points, each with the gradients B kept there and
// which of its edges go down the input's path, and the parameters.
struct SplitBackward::Plan {
  struct Branch {
    Node* node;
    std::shared_ptr<Kept> kept;
    std::vector<size_t> pathEdges;
  };
  std::vector<Branch> branches;
  torch::autograd::edge_list params;
  // The nodes B runs and W does not (on the input's path, not a branch
  // point): their saved tensors are released once B is done.
  std::vector<Node*> onlyInB;
};

SplitBackward::SplitBackward(torch::Tensor output, torch::Tensor gradOutput, torch::Tensor input,
                             const std::vector<torch::Tensor>& params)
    : output_(std::move(output)), gradOutput_(std::move(gradOutput)), input_(std::move(input)) {
  if (!output_.requires_grad()) return;  // nothing in the piece needs a gradient
  if (!input_.defined()) {
    mode_ = Mode::kAllInW;
    return;
  }
  plan(params);
}

SplitBackward::~SplitBackward() = default;

void SplitBackward::plan(const std::vector<torch::Tensor>& params) {
  mode_ = Mode::kAllInB;
  Node* root = output_.grad_fn().get();
  const auto inputAcc = torch::autograd::impl::try_get_grad_accumulator(input_);
  if (!root || !inputAcc) return;
  std::unordered_map<Node*, int> paramOf;
  for (size_t p = 0; p < params.size(); ++p) {
    if (auto acc = torch::autograd::impl::try_get_grad_accumulator(params[p])) paramOf[acc.get()] = static_cast<int>(p);
  }
  const int P = static_cast<int>(params.size());

  // Which nodes lead to the input, and which parameters each off-path node leads to.
  const auto order = postOrder(root);
  std::unordered_map<Node*, bool> onPath;
  std::unordered_map<Node*, std::set<int>> paramsBelow;
  for (Node* node : order) {
    bool path = node == inputAcc.get();
    std::set<int> below;
    if (auto it = paramOf.find(node); it != paramOf.end()) {
      below.insert(it->second);
    } else if (!path && dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      return;  // a leaf that is neither the input nor a parameter: W would not give it its gradient
    }
    for (const Edge& e : node->next_edges()) {
      Node* child = e.function.get();
      if (!child) continue;
      path = path || onPath[child];
      if (!onPath[child]) below.insert(paramsBelow[child].begin(), paramsBelow[child].end());
    }
    onPath[node] = path;
    if (!path) paramsBelow[node] = std::move(below);
  }
  if (!onPath[root]) return;  // the output does not depend on the input

  // Branch points: on the path, with an edge to an off-path node that leads to parameters.
  std::vector<Node*> branches;
  std::vector<std::set<int>> branchParams;
  for (Node* node : order) {
    if (!onPath[node]) continue;
    std::set<int> reached;
    for (const Edge& e : node->next_edges()) {
      Node* child = e.function.get();
      if (child && !onPath[child]) reached.insert(paramsBelow[child].begin(), paramsBelow[child].end());
    }
    if (reached.empty()) continue;
    branches.push_back(node);
    branchParams.push_back(std::move(reached));
  }
  // (Every parameter in the graph branches off the path somewhere: the edge
  // into its accumulator leaves the path at the latest at the root.)
  std::set<int> covered;
  for (const auto& s : branchParams) covered.insert(s.begin(), s.end());
  // A branch point runs again in W: hooks on its gradients (register_hook,
  // retain_grad) would see them twice.
  for (Node* node : branches) {
    if (!node->tensor_pre_hooks().empty() || !node->retains_grad_hooks().empty()) return;
  }

  // Groups: branch points and parameters joined where they share a parameter.
  const int B = static_cast<int>(branches.size());
  Components comps(B + P);
  for (int b = 0; b < B; ++b) {
    for (int p : branchParams[b]) comps.join(b, B + p);
  }
  // A branch point must not have another of its own group below it on the path.
  std::unordered_map<Node*, int> branchIndex;
  for (int b = 0; b < B; ++b) branchIndex[branches[b]] = b;
  std::unordered_map<Node*, std::set<int>> groupsAtOrBelow;  // on-path nodes only
  for (Node* node : order) {
    if (!onPath[node]) continue;
    std::set<int> groups;
    for (const Edge& e : node->next_edges()) {
      Node* child = e.function.get();
      if (!child || !onPath[child]) continue;
      const auto& below = groupsAtOrBelow[child];
      groups.insert(below.begin(), below.end());
    }
    if (auto it = branchIndex.find(node); it != branchIndex.end()) {
      if (groups.count(comps.find(it->second))) return;  // a weight used twice along the path
      groups.insert(comps.find(it->second));
    }
    groupsAtOrBelow[node] = std::move(groups);
  }

  auto planned = std::make_unique<Plan>();
  for (Node* node : branches) {
    auto kept = std::make_shared<Kept>();
    node->add_pre_hook(std::make_unique<KeepGradients>(kept));
    std::vector<size_t> down;
    for (size_t e = 0; e < node->next_edges().size(); ++e) {
      Node* child = node->next_edges()[e].function.get();
      if (child && onPath[child]) down.push_back(e);
    }
    planned->branches.push_back({node, std::move(kept), std::move(down)});
  }
  for (const auto& [acc, p] : paramOf) {
    if (covered.count(p)) planned->params.push_back(torch::autograd::impl::gradient_edge(params[p]));
  }
  const std::set<Node*> branchSet(branches.begin(), branches.end());
  for (Node* node : order) {
    if (onPath[node] && !branchSet.count(node)) planned->onlyInB.push_back(node);
  }
  plan_ = std::move(planned);
  mode_ = Mode::kSplit;
}

void SplitBackward::inputGradient() {
  VARUNA_CHECK(!inputDone_, "the input gradient of a piece was asked for twice");
  inputDone_ = true;
  switch (mode_) {
    case Mode::kNothing:
    case Mode::kAllInW:
      return;
    case Mode::kAllInB:
      torch::autograd::backward({output_}, {gradOutput_});
      return;
    case Mode::kSplit:
      torch::autograd::backward({output_}, {gradOutput_}, /*retain_graph=*/true, /*create_graph=*/false, {input_});
      for (auto& branch : plan_->branches) branch.kept->active = false;
      // What only B needed goes now, as a whole backward frees it node by
      // node: the piece holds until W just what W reads.
      for (Node* node : plan_->onlyInB) node->release_variables();
      return;
  }
}

void SplitBackward::weightGradient() {
  VARUNA_CHECK(inputDone_ && !weightDone_, "a piece's weight gradient before its input gradient, or twice");
  weightDone_ = true;
  if (mode_ == Mode::kAllInW) torch::autograd::backward({output_}, {gradOutput_});
  if (mode_ == Mode::kSplit) runWeightBranches();
  plan_.reset();
  output_ = gradOutput_ = torch::Tensor();
}

void SplitBackward::runWeightBranches() {
  // One engine call from every branch point, each one's edges down the
  // input's path cut for the call: the engine never goes down the path from
  // one branch point to the next (which would run the path again and count
  // the lower one's gradient twice), so each parameter gets what its own
  // branch points pass it. One call instead of one per group of branch
  // points (ten for a GPT block) saves the engine's set-up and its walk
  // over the graph below each root.
  torch::autograd::edge_list roots;
  variable_list grads;
  std::vector<std::pair<Edge*, Edge>> cut;  // an edge of a branch point, and what it was
  struct Restore {  // the edges go back even if the engine throws
    std::vector<std::pair<Edge*, Edge>>& cut;
    ~Restore() {
      for (auto& [edge, was] : cut) *edge = std::move(was);
    }
  } restore{cut};
  for (auto& branch : plan_->branches) {
    Node* node = branch.node;
    for (size_t e : branch.pathEdges) {
      Edge& edge = node->next_edges()[e];
      cut.emplace_back(&edge, std::exchange(edge, Edge()));
    }
    const auto& kept = branch.kept->grads;
    for (uint32_t j = 0; j < node->num_inputs(); ++j) {
      roots.emplace_back(node->getptr(), j);
      const bool have = j < kept.size() && kept[j].defined();
      grads.push_back(have ? kept[j] : node->input_metadata(j).zeros_like());
    }
  }
  auto& engine = torch::autograd::Engine::get_default_engine();
  engine.execute(roots, grads, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true,
                 plan_->params);
}

}  // namespace varuna
