"""The manual's CutPoints: mark possible stage boundaries inside an ordinary
torch.nn.Module's forward, and split the module there into the pieces the
runtime runs (docs/python.md, "CutPoints").

The split captures the forward once with torch.export (non-strict) on the
sample inputs of get_batch_fn, on a copy of the model on the meta device
(_capture.py), and cuts the graph at every CutPoint (_split.py), so every
CutPoint is a piece boundary and the partitioner picks which ones become
stage boundaries. The forward runs as written: shape arithmetic, *args and
keyword arguments, dataclass and ModelOutput returns (the loss is taken from
them), asserts and Python control flow on anything but tensor values.
Rules, checked here whatever the layout, so that a model that works on one
layout works on all of them:

- only the CutPoint's one tensor (batch first) crosses it;
- values computed from the forward's inputs alone (masks, position ids,
  rotary tables) may be used anywhere: each piece that needs one computes it
  again (random ones may not: they cross like any value; in-place changes to
  inputs are refused);
- a parameter is used between two neighbouring CutPoints only, unless it is
  held under more names (PyTorch's tie, `self.head.weight =
  self.embed.weight`): then each piece using it holds its own copy under the
  name of the module that uses it there, and the copies are kept equal as a
  shared-weight pair (the manual's form, a separate Parameter per use named
  in shared_weights, works too);
- each CutPoint is called exactly once.

A forward whose control flow depends on tensor values cannot be split this
way (the refusal names the line); such a model is given as pieces instead.
"""
import itertools
import zlib

import torch

from . import _C
from ._capture import capture, meta_copy, trace_symbolically
from ._piece import PieceBuilder, install_evaluation, materialise
from ._split import Split, refuse

__all__ = ["CutPoint", "split_at_cutpoints", "find_cutpoints", "initialize", "SplitModel"]

_next_index = itertools.count()


@torch.library.custom_op("varuna::cut", mutates_args=())
def _cut(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """The mark a CutPoint leaves in a captured graph. Never run in training
    (the split replaces it), only seen by torch.export and torch.fx."""
    return tensor.clone()


@_cut.register_fake
def _(tensor, index):
    return torch.empty_like(tensor)


_cut.register_autograd(lambda ctx, grad: (grad, None))


class CutPoint(torch.nn.Module):
    """A possible pipeline-stage boundary: call it on the one tensor (batch
    first) that would cross it. Each instance is called once per forward. In
    a plain forward (the model run by itself) it returns the tensor as is."""

    def __init__(self):
        super().__init__()
        self.index = next(_next_index)

    def forward(self, tensor):
        if torch.compiler.is_exporting() or isinstance(tensor, torch.fx.Proxy):
            return torch.ops.varuna.cut(tensor, self.index)
        return tensor


def find_cutpoints(model):
    """{CutPoint.index: where it is ("cutpoints[3]", "blocks.2.cut")} for every
    CutPoint the model holds, registered or in a plain list, tuple or dict."""
    found = {}
    for prefix, module in model.named_modules():
        dot = prefix + "." if prefix else ""
        for attr, value in vars(module).items():
            if attr.startswith("_"):
                continue
            items = value.items() if isinstance(value, dict) else enumerate(value) \
                if isinstance(value, (list, tuple)) else ()
            for key, item in items:
                if isinstance(item, CutPoint):
                    found.setdefault(item.index, "%s%s[%r]" % (dot, attr, key))
        for name, child in module.named_children():
            if isinstance(child, CutPoint):
                found.setdefault(child.index, dot + name)
    return found


def _is_meta(module):
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def _module_seed(seed, name):
    return (seed * 1000003 + zlib.crc32(name.encode())) % (2 ** 63)


def initialize(module, init_fn=None, seed=0, only=None):
    """Initialises every submodule of `module` that holds parameters or
    buffers of its own (those whose path is in `only`, when given), each
    under torch.manual_seed derived from `seed` and its name (so a weight's
    initial value depends on neither the layout nor what else was built
    first): init_fn(name, submodule) if given, else the submodule's
    reset_parameters(). A tensor held by two submodules (a tie) is
    initialised by the first only. Apply it to a normally built model to get
    the weights a meta-built one gets."""
    done = set()
    for name, sub in module.named_modules():
        own = list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False))
        fresh = [t for _, t in own if id(t) not in done]
        done.update(id(t) for _, t in own)
        if not fresh or (only is not None and name not in only):
            continue
        torch.manual_seed(_module_seed(seed, name))
        if init_fn is not None:
            init_fn(name, sub)
        elif hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
        else:
            raise _C.ConfigError("'%s' (%s) holds %s but has no reset_parameters(): give Varuna an "
                                 "init_fn(name, module) that initialises it (a model built on the meta device "
                                 "has no values)" % (name or "the model", type(sub).__name__,
                                                     ", ".join(n for n, _ in own)))


class SplitModel:
    """A CutPoint model split into pieces (split_at_cutpoints).

    pieces: [(name, factory, parameter count)] as the runtime takes them;
      piece k's factory builds the module for the code between CutPoints k-1
      and k ("piece<k>").
    names: the model's name of each parameter and buffer -> the runtime's
      ("piece<k>.<name>"; a buffer several pieces use: the first's); every
      name of a tied tensor is there.
    model_names: the runtime's name of each piece's parameters and buffers
      -> the model's.
    ties: [(runtime name, runtime name)] of tensors the model holds under two
      names and uses in two pieces: shared-weight pairs.
    release(): drops the reference to the model once the runtime has built
      its pieces (a rank keeps only what it owns).
    prepare_evaluation(): captures the forward in evaluation mode and gives
      every piece built so far its evaluation graph (once).
    """

    def __init__(self, model, split, sample_inputs, init_fn, seed):
        self._holder = {"model": model}
        self._split = split
        self._sample_inputs = sample_inputs
        self._init_fn, self._seed = init_fn, seed
        self._on_meta = _is_meta(model)
        self._graphs = [split.piece_graph(k) for k in range(len(split.cuts) + 1)]
        self._builder = PieceBuilder(split, self._graphs)
        self._built = {}  # k -> piece module
        self._eval_model = None  # what evaluation captures from, kept past release (no values)
        self.pieces, self.names, self.model_names = [], {}, {}
        sizes = {n: p.numel() for n, p in model.named_parameters(remove_duplicate=False)}
        for k, graph in enumerate(self._graphs):
            for n in split.params_of[k]:
                self.names[n] = "piece%d.%s" % (k, n)
            for node in graph.nodes:
                if node.op in ("get_attr", "call_module"):
                    self.model_names["piece%d.%s" % (k, node.target)] = node.target
                    if node.target not in split.params_of[k]:
                        self.names.setdefault(node.target, "piece%d.%s" % (k, node.target))
            count = sum(sizes[n] for n in split.params_of[k])
            self.pieces.append(("piece%d" % k, self._factory(k), count))
        for names in split.names_of.values():  # a tie used in one piece: all its names are that one
            used = [self.names[n] for n in names if n in self.names]
            for n in names:
                if used:
                    self.names.setdefault(n, used[0])
        self.ties = [(self.names[a], self.names[b]) for a, b in split.ties]

    def __iter__(self):
        """(pieces, names, release): what split_at_cutpoints returned before
        it returned this object."""
        return iter((self.pieces, self.names, self.release))

    def _factory(self, k):
        def factory():
            root = self._holder.get("model")
            if root is None:
                raise RuntimeError("piece %d was asked for after the model was released" % k)
            name = "VarunaPiece%d" % k
            piece = self._builder.build(root, k, name)
            if self._on_meta:
                piece = materialise(root, piece, lambda r: self._builder.build(r, k, name), self._init_fn,
                                    self._seed, initialize)
            self._built[k] = piece
            return piece
        return factory

    def release(self):
        model = self._holder.pop("model", None)
        if model is not None and self._sample_inputs is not None:
            self._eval_model = meta_copy(model)

    def prepare_evaluation(self):
        if self._sample_inputs is None or all("_varuna_eval_forward" in p.__dict__ for p in self._built.values()):
            return
        model = self._holder.get("model")
        model = self._eval_model if model is None else model
        captured = capture(model, self._sample_inputs, training=False)
        split = Split(model, captured, self._split.where)
        if [sorted(p) for p in split.params_of] != [sorted(p) for p in self._split.params_of]:
            refuse("in evaluation mode the model's forward uses its parameters between other CutPoints than in "
                   "training mode; the pieces cannot change with the mode")
        for k, piece in self._built.items():
            install_evaluation(piece, split.piece_graph(k), captured.module)


def split_at_cutpoints(model, init_fn=None, seed=0, sample_inputs=None):
    """The model split at its CutPoints, as a SplitModel. sample_inputs (a
    dict of tensors, batch first: what get_batch_fn returns) are what the
    forward is captured on; without them it is traced symbolically with
    torch.fx, which cannot follow shape arithmetic and gives no evaluation
    graphs (for looking at a model's structure only). A model on the meta
    device is materialised piece by piece (only the pieces a rank owns, on
    the CPU) and initialised with initialize()."""
    where = find_cutpoints(model)
    if not where:
        refuse("the model has no CutPoint: mark the possible stage boundaries in its forward with "
               "varuna.CutPoint (docs/python.md)")
    if sample_inputs is None:
        captured = trace_symbolically(model, CutPoint)
    else:
        captured = capture(model, sample_inputs)
    return SplitModel(model, Split(model, captured, where), sample_inputs, init_fn, seed)
