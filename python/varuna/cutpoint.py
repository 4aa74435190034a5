"""The manual's CutPoints: mark possible stage boundaries inside an ordinary
torch.nn.Module's forward, and split the module there into the pieces the
runtime runs (docs/python.md, "CutPoints").

The split traces the module's forward once with torch.fx (symbolically: no
data runs) and cuts the graph at every CutPoint, so every CutPoint is a piece
boundary and the partitioner picks which ones become stage boundaries. Rules,
checked here whatever the layout, so that a model that works on one layout
works on all of them:

- only the CutPoint's one tensor (batch first) crosses it;
- values computed from the forward's inputs alone (masks, position ids) may be
  used anywhere: each piece that needs one recomputes it (random ones may
  not: they cross like any value; in-place changes to inputs are refused);
- a parameter is used between two neighbouring CutPoints only (give a weight
  used on both sides of one its own Parameter and name the pair in
  shared_weights, the manual's rule);
- each CutPoint is called exactly once.

What fx cannot trace (control flow that depends on tensor values) cannot be
split this way; such a model is given as pieces instead (docs/python.md).
"""
import itertools
import operator
import zlib

import torch
import torch.fx

from . import _C

__all__ = ["CutPoint", "split_at_cutpoints", "find_cutpoints", "initialize"]

_next_index = itertools.count()


def _varuna_cut(tensor, index):
    """The mark a CutPoint leaves in a traced graph (identity when run)."""
    return tensor


torch.fx.wrap("_varuna_cut")


class CutPoint(torch.nn.Module):
    """A possible pipeline-stage boundary: call it on the one tensor (batch
    first) that would cross it. Each instance is called once per forward."""

    def __init__(self):
        super().__init__()
        self.index = next(_next_index)

    def forward(self, tensor):
        return _varuna_cut(tensor, self.index)


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


class _Tracer(torch.fx.Tracer):
    """Traces through CutPoints (even ones in a plain list, which fx cannot
    name as submodules): each leaves its _varuna_cut node."""

    def __init__(self):
        super().__init__()
        self.record_stack_traces = True

    def call_module(self, m, forward, args, kwargs):
        if isinstance(m, CutPoint):
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)


def _refuse(message, node=None):
    where = _user_line(node) if node is not None else ""
    raise _C.ConfigError(message + (" (%s)" % where if where else ""))


def _user_line(node):
    """The last frame of the user's code in the node's stack trace."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")]
    frames = [f for f in frames if "/torch/" not in f and "/varuna/" not in f]
    return frames[-1] if frames else ""


def _is_cut(node):
    return node.op == "call_function" and node.target is _varuna_cut


_RANDOM = {torch.rand, torch.rand_like, torch.randn, torch.randn_like, torch.randint, torch.randint_like,
           torch.randperm, torch.bernoulli, torch.normal, torch.multinomial, torch.poisson, torch.dropout,
           torch.nn.functional.dropout}
_RANDOM_METHODS = {"bernoulli", "multinomial", "uniform_", "normal_", "random_", "exponential_"}


def _in_place(node):
    """An operation that changes its first argument."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("__")
    if node.op == "call_function":
        return node.target is operator.setitem or getattr(node.target, "__name__", "").endswith("_")
    return False


def _random(node):
    return (node.op == "call_function" and node.target in _RANDOM) or \
        (node.op == "call_method" and node.target in _RANDOM_METHODS)


class _Split:
    """The traced graph cut into segments, checked against the rules above."""

    def __init__(self, model, cutpoints):
        self.model = model
        self.where = cutpoints
        try:
            self.graph = _Tracer().trace(model)
        except Exception as error:  # noqa: BLE001 - any tracing failure is the user's to see
            raise _C.ConfigError("the model's forward could not be traced with torch.fx to split it at its "
                                 "CutPoints (%s: %s); a forward whose control flow depends on tensor values "
                                 "must be given as pieces instead (docs/python.md)"
                                 % (type(error).__name__, error)) from error
        self.nodes = list(self.graph.nodes)
        self.cuts = []          # cut nodes in order; cut k ends segment k
        self.segment = {}       # node -> segment
        self.input_only = set()  # nodes computed from the forward's inputs alone
        self._assign_segments()
        self._check_crossings()
        self.params_of = self._check_parameters()

    def name_of_cut(self, k):
        return "CutPoint %s" % self.where.get(self.cuts[k].args[1], "#%d" % self.cuts[k].args[1])

    def _assign_segments(self):
        seen = {}
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        for node in self.nodes:
            # Inputs and constants (buffers, tensors the module holds) are
            # available in every piece.
            if node.op == "placeholder" or (node.op == "get_attr" and node.target not in parameters):
                self.input_only.add(node)
                continue
            if node.op == "output":
                self.segment[node] = len(self.cuts)
                continue
            # Made from inputs and constants alone (or from nothing): any
            # piece can compute it again, unless it draws random numbers
            # (each piece would draw its own) or changes something.
            if _in_place(node) and node.args and isinstance(node.args[0], torch.fx.Node) and \
                    node.args[0] in self.input_only and node.args[0].op != "get_attr":
                _refuse("the in-place operation '%s' changes '%s', a value made from the inputs that every piece "
                        "needing it computes on its own: use the out-of-place form (e.g. x = x.masked_fill(...))"
                        % (node.target if isinstance(node.target, str) else node.target.__name__,
                           node.args[0].name), node)
            if node.op in ("call_function", "call_method") and not _is_cut(node) and not _random(node) and \
                    all(d in self.input_only for d in node.all_input_nodes):
                self.input_only.add(node)
                continue
            self.segment[node] = len(self.cuts)
            if _is_cut(node):
                index = node.args[1]
                if index in seen:
                    _refuse("CutPoint %s is called twice (its first call %s); use each CutPoint instance once"
                            % (self.where.get(index, "#%d" % index), _user_line(seen[index]) or "earlier"), node)
                seen[index] = node
                self.cuts.append(node)
        never = sorted(path for index, path in self.where.items() if index not in seen)
        if never:
            _refuse("CutPoint %s is never called by the model's forward; call every CutPoint once on the "
                    "tensor that crosses it, or remove it" % never[0])
        if not self.cuts:
            _refuse("the model has no CutPoint: mark the possible stage boundaries in its forward with "
                    "varuna.CutPoint (docs/python.md)")

    def _check_crossings(self):
        for node in self.nodes:
            if node in self.input_only:
                continue
            here = self.segment[node]
            for dep in node.all_input_nodes:
                if dep in self.input_only or dep.op == "get_attr":
                    continue
                there = self.segment[dep]
                if there == here or (_is_cut(dep) and self.cuts.index(dep) == here - 1):
                    continue
                crossed = self.name_of_cut(there if there < here else here)
                _refuse("the value '%s' (%s) crosses %s: only the tensor a CutPoint is called on crosses it "
                        "(values made from the inputs alone may be used anywhere); pass it through the "
                        "CutPoint or compute it after" % (dep.name, _user_line(dep) or "?", crossed), node)

    def _check_parameters(self):
        """[set of parameter names] per segment; a parameter in two is refused."""
        named = dict(self.model.named_parameters(remove_duplicate=False))
        by_id = {}
        for name, param in named.items():
            by_id.setdefault(id(param), name)
        used = {}  # first name of a parameter -> (segment, node)
        params_of = [set() for _ in range(len(self.cuts) + 1)]
        for node in self.nodes:
            if node.op == "call_module":
                prefix = node.target + "."
                names = [n for n in named if n.startswith(prefix)]
            elif node.op == "get_attr" and node.target in named:
                names = [node.target]
            else:
                continue
            for user in node.users if node.op == "get_attr" else [node]:
                seg = self.segment[user]
                for name in names:
                    first = by_id[id(named[name])]
                    if first in used and used[first][0] != seg:
                        _refuse("the parameter '%s' is used on both sides of %s (%s and %s): give each use its "
                                "own nn.Parameter and name the pair in shared_weights (the manual's rule)"
                                % (first, self.name_of_cut(min(seg, used[first][0])),
                                   _user_line(used[first][1]) or "?", _user_line(user) or "?"), user)
                    used.setdefault(first, (seg, user))
                    params_of[seg].add(name)
        return params_of

    def piece_graph(self, k):
        """Segment k as a graph forward(activation, inputs) -> tensor."""
        graph = torch.fx.Graph()
        activation = graph.placeholder("activation")
        inputs = graph.placeholder("inputs")
        env = {}

        def value(node):
            if node in env:
                return env[node]
            if k > 0 and node is self.cuts[k - 1]:
                return activation
            if node.op == "placeholder":
                default = node.args[0] if node.args else None
                env[node] = graph.call_method("get", (inputs, node.target, default))
            elif node in self.input_only or node.op == "get_attr":
                env[node] = graph.node_copy(node, value)
            else:
                raise AssertionError("node %s of segment %s reached from segment %d" % (node, self.segment.get(node), k))
            return env[node]

        for node in self.nodes:
            if node.op in ("placeholder", "output", "get_attr") or node in self.input_only:
                continue
            if self.segment[node] != k or (_is_cut(node) and self.cuts.index(node) == k):
                continue
            env[node] = graph.node_copy(node, value)
        end = self.cuts[k].args[0] if k < len(self.cuts) else self.nodes[-1].args[0]
        if k == len(self.cuts) and not isinstance(end, torch.fx.Node):
            _refuse("the model's forward must return the loss (one tensor)")
        graph.output(value(end))
        graph.lint()
        return graph


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
    reset_parameters(). Apply it to a normally built model to get the
    weights a meta-built one gets."""
    for name, sub in module.named_modules():
        own = list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False))
        if not own or (only is not None and name not in only):
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


def _materialise(root, piece, graph, k, init_fn, seed):
    """Piece k of a meta-built model with values: the model's own submodules
    that hold the piece's tensors (their classes, their reset_parameters) are
    materialised on the CPU and initialised as initialize() would, then the
    piece is built again over them."""
    owners = {name.rpartition(".")[0] for name, _ in
              itertools.chain(piece.named_parameters(remove_duplicate=False), piece.named_buffers(remove_duplicate=False))}
    for path in owners:
        root.get_submodule(path).to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        initialize(root, init_fn, seed, only=owners)
    piece = torch.fx.GraphModule(root, graph, class_name="VarunaPiece%d" % k)
    for name, tensor in itertools.chain(piece.named_parameters(), piece.named_buffers()):
        if tensor.is_meta:
            raise _C.ConfigError("'%s' is a plain tensor attribute of a model built on the meta device: it has "
                                 "no values; register it as a buffer (register_buffer) so that it is "
                                 "materialised and initialised with its module" % name)
    return piece


def split_at_cutpoints(model, init_fn=None, seed=0):
    """(pieces, names, release): pieces as the runtime takes them, [(name,
    factory, parameter count)], where piece k's factory builds the module for
    the code between CutPoints k-1 and k from `model`; names maps each
    original parameter name to the runtime's ("piece<k>.<name>"); release()
    drops the reference to `model` once the runtime has built its pieces.
    A model on the meta device is materialised piece by piece (only the
    pieces a rank owns, on the CPU) and initialised with initialize()."""
    where = find_cutpoints(model)
    on_meta = _is_meta(model)
    split = _Split(model, where)
    holder = {"model": model}
    pieces, names = [], {}
    sizes = {n: p.numel() for n, p in model.named_parameters(remove_duplicate=False)}
    for k in range(len(split.cuts) + 1):
        graph = split.piece_graph(k)
        piece_name = "piece%d" % k
        for n in split.params_of[k]:
            names[n] = "%s.%s" % (piece_name, n)

        def factory(graph=graph, k=k):
            root = holder.get("model")
            if root is None:
                raise RuntimeError("piece %d was asked for after the model was released" % k)
            piece = torch.fx.GraphModule(root, graph, class_name="VarunaPiece%d" % k)
            if on_meta:
                piece = _materialise(root, piece, graph, k, init_fn, seed)
            return piece
        count = sum(sizes[n] for n in split.params_of[k])
        pieces.append((piece_name, factory, count))
    return pieces, names, holder.clear
