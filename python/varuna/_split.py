"""A captured forward (_capture.py) cut at its CutPoints into the graphs of
the pieces, checked against the CutPoint rules (cutpoint.py's docstring).

Segment k is the code between CutPoints k-1 and k. Values computed from the
forward's inputs and constants alone ("input-only": masks, position ids,
rotary tables) are not assigned a segment: each piece that needs one
computes it again. A parameter belongs to the one segment that uses it; a
tensor held under several names (PyTorch's own tie, `lm_head.weight =
embed.weight`) may be used in as many segments as it has names, each segment
taking the name of the module that uses it there, and the pairs become
shared-weight ties (each piece its own copy, kept equal by the runtime).
"""
import operator

import torch
import torch.fx
from torch.fx.node import map_aggregate

from . import _C

_RANDOM = {torch.rand, torch.rand_like, torch.randn, torch.randn_like, torch.randint, torch.randint_like,
           torch.randperm, torch.bernoulli, torch.normal, torch.multinomial, torch.poisson, torch.dropout,
           torch.nn.functional.dropout}
_RANDOM_METHODS = {"bernoulli", "multinomial", "uniform_", "normal_", "random_", "exponential_"}


def refuse(message, node=None):
    where = user_line(node) if node is not None else ""
    raise _C.ConfigError(message + (" (%s)" % where if where else ""))


def user_line(node):
    """The last frame of the user's code in the node's stack trace."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")]
    frames = [f for f in frames if "/torch/" not in f and "/varuna/" not in f]
    return frames[-1] if frames else ""


def is_cut(node):
    return node.op == "call_function" and node.target in (torch.ops.varuna.cut, torch.ops.varuna.cut.default)


def _op_name(node):
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _in_place(node):
    """An operation that changes its first argument."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("__")
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    return node.target is operator.setitem or _op_name(node).endswith("_")


def _random(node):
    if isinstance(node.target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in node.target.tags
    return (node.op == "call_function" and node.target in _RANDOM) or \
        (node.op == "call_method" and node.target in _RANDOM_METHODS)


def _module_path(node):
    """The innermost module whose forward made this node ("" for the model's
    own forward), from export's nn_module_stack."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) and not path.startswith("L[") else ""


def value_name(node):
    """How a refusal names a value: its module's path when a submodule made
    it ('wte'), else the graph's name for it."""
    if node.op == "call_module":
        return node.name
    return _module_path(node) or node.name


def _loss_leaf(spec):
    """Which leaf of a forward's flattened output is the loss: the value
    itself, the "loss" entry of a dict or ModelOutput, or the first of a
    tuple; None when there is no such leaf."""
    if spec.is_leaf():
        return 0
    children = spec.children()
    keys = spec.context if isinstance(spec.context, list) else None
    if keys is not None and "loss" in keys:
        i = keys.index("loss")
    elif spec.type in (tuple, list) and children:
        i = 0
    else:
        return None
    inner = _loss_leaf(children[i])
    return None if inner is None else sum(c.num_leaves for c in children[:i]) + inner


class Split:
    """`captured` (from `model`, whose CutPoints are `where`: index -> path)
    cut into segments, checked; piece_graph(k) is segment k's graph."""

    def __init__(self, model, captured, where):
        self.captured = captured
        self.where = where
        self.nodes = list(captured.graph.nodes)
        self.parameters = dict(model.named_parameters(remove_duplicate=False))
        self.names_of = {}  # id(parameter) -> its names, in the model's order
        for name, p in self.parameters.items():
            self.names_of.setdefault(id(p), []).append(name)
        self.cuts = []           # cut nodes in order; cut k ends segment k
        self.segment = {}        # node -> segment
        self.input_only = set()  # nodes computed from the forward's inputs and constants alone
        self._assign_segments()
        self._check_crossings()
        self.params_of, self.name_in, self.ties = self._assign_parameters()
        self.loss = self._loss_node()

    def name_of_cut(self, k):
        index = self.cuts[k].args[1]
        return "CutPoint %s" % self.where.get(index, "#%d" % index)

    # --- segments ------------------------------------------------------------------
    def _assign_segments(self):
        seen = {}
        for node in self.nodes:
            # Inputs and constants (buffers, tensors the module holds) are
            # available in every piece.
            if node.op == "placeholder" or (node.op == "get_attr" and node.target not in self.parameters):
                self.input_only.add(node)
                continue
            if node.op == "output":
                self.segment[node] = len(self.cuts)
                continue
            if _in_place(node) and node.args and isinstance(node.args[0], torch.fx.Node):
                changed = node.args[0]
                if changed in self.input_only and changed.op != "get_attr":
                    refuse("the in-place operation '%s' changes '%s', a value made from the inputs that every "
                           "piece needing it computes on its own: use the out-of-place form (e.g. x = "
                           "x.masked_fill(...))" % (_op_name(node), changed.name), node)
                if changed.op == "get_attr":  # a buffer's update (BatchNorm's count): where it happens
                    self.segment[node] = len(self.cuts)
                    continue
            # Made from inputs and constants alone (or from nothing): any
            # piece can compute it again, unless it draws random numbers
            # (each piece would draw its own) or changes something.
            if node.op in ("call_function", "call_method") and not is_cut(node) and not _random(node) and \
                    not _in_place(node) and all(d in self.input_only for d in node.all_input_nodes):
                self.input_only.add(node)
                continue
            self.segment[node] = len(self.cuts)
            if is_cut(node):
                index = node.args[1]
                if index in seen:
                    refuse("CutPoint %s is called twice (its first call %s); use each CutPoint instance once"
                           % (self.where.get(index, "#%d" % index), user_line(seen[index]) or "earlier"), node)
                seen[index] = node
                self.cuts.append(node)
        never = sorted(path for index, path in self.where.items() if index not in seen)
        if never:
            refuse("CutPoint %s is never called by the model's forward; call every CutPoint once on the "
                   "tensor that crosses it, or remove it" % never[0])
        if not self.cuts:
            refuse("the model has no CutPoint: mark the possible stage boundaries in its forward with "
                   "varuna.CutPoint (docs/python.md)")

    def _check_crossings(self):
        for node in self.nodes:
            if node in self.input_only:
                continue
            here = self.segment[node]
            for dep in node.all_input_nodes:
                if dep in self.input_only or dep.op == "get_attr" or _symbolic(dep):
                    continue
                there = self.segment[dep]
                if there == here or (is_cut(dep) and self.cuts.index(dep) == here - 1):
                    continue
                crossed = self.name_of_cut(there if there < here else here)
                refuse("the value '%s' (%s) crosses %s: only the tensor a CutPoint is called on crosses it "
                       "(values made from the inputs alone may be used anywhere); pass it through the "
                       "CutPoint or compute it after" % (value_name(dep), user_line(dep) or "?", crossed), node)

    # --- parameters ------------------------------------------------------------------
    def _uses(self):
        """{id(parameter): {segment: first node using it there}} and the
        graph's name of each (the get_attr target, or a module's path)."""
        uses, graph_name = {}, {}
        for node in self.nodes:
            if node.op == "call_module":
                prefix = node.target + "."
                names = [n for n in self.parameters if n.startswith(prefix)]
                users = [node]
            elif node.op == "get_attr" and node.target in self.parameters:
                names = [node.target]
                users = list(node.users)
            else:
                continue
            for user in users:
                if user in self.input_only:
                    continue
                for name in names:
                    key = id(self.parameters[name])
                    graph_name.setdefault(key, name)
                    uses.setdefault(key, {}).setdefault(self.segment[user], user)
        return uses, graph_name

    def _assign_parameters(self):
        """([names per segment], [{graph name: the segment's name}], ties):
        a parameter used in one segment keeps its graph name; one used in
        several takes one of its names in each (the name of the module that
        uses it there, else the next unused), tied to the first of them in
        the model's order."""
        uses, graph_name = self._uses()
        params_of = [set() for _ in range(len(self.cuts) + 1)]
        name_in = [dict() for _ in range(len(self.cuts) + 1)]
        ties = []
        for key, by_segment in uses.items():
            segments = sorted(by_segment)
            names = self.names_of[key]
            if len(segments) == 1:
                params_of[segments[0]].add(graph_name[key])
                continue
            if len(segments) > len(names):
                first, other = segments[0], segments[1]
                refuse("the parameter '%s' is used on both sides of %s (%s and %s): give each use its own "
                       "nn.Parameter and name the pair in shared_weights (the manual's rule), or hold it under "
                       "one more name in the module that uses it there (self.head.weight = self.embed.weight, "
                       "as PyTorch ties weights)" % (graph_name[key], self.name_of_cut(first),
                                                     user_line(by_segment[first]) or "?",
                                                     user_line(by_segment[other]) or "?"), by_segment[other])
            chosen = self._names_by_segment(segments, by_segment, names)
            for seg in segments:
                params_of[seg].add(chosen[seg])
                name_in[seg][graph_name[key]] = chosen[seg]
            # The model's first name of it leads (as initialize() gives the
            # tensor its first owner's initial values): the others copy it.
            used = sorted(chosen.values(), key=names.index)
            ties += [(used[0], other) for other in used[1:]]
        return params_of, name_in, ties

    @staticmethod
    def _names_by_segment(segments, by_segment, names):
        chosen, free = {}, list(names)
        for seg in segments:
            owner = _module_path(by_segment[seg])
            match = [n for n in free if n.rpartition(".")[0] == owner]
            chosen[seg] = (match or free)[0]
            free.remove(chosen[seg])
        return chosen

    def _loss_node(self):
        value = self.nodes[-1].args[0]
        if self.captured.out_spec is not None:
            leaf = _loss_leaf(self.captured.out_spec)
            value = value[leaf] if leaf is not None else None
        if not isinstance(value, torch.fx.Node):
            refuse("the model's forward must return the loss: one tensor, or a dict, ModelOutput or tuple "
                   "holding it (under 'loss', or first)")
        return value

    # --- the pieces' graphs ----------------------------------------------------------
    def piece_graph(self, k):
        """Segment k as a graph forward(activation, inputs) -> tensor."""
        return _PieceGraph(self, k).build()


def _symbolic(node):
    """A node whose value is a size (torch.SymInt), not data."""
    return isinstance(node.meta.get("val"), torch.SymInt)


class _PieceGraph:
    """Copies segment k's nodes into a graph of its own: the previous cut is
    the activation, inputs come from the inputs dict, input-only values and
    constants are computed again, the capture's device becomes the piece's."""

    def __init__(self, split, k):
        self.split = split
        self.k = k
        self.graph = torch.fx.Graph()
        self.activation = self.graph.placeholder("activation")
        self.inputs = self.graph.placeholder("inputs")
        self.env = {}
        self.device = None  # a node giving this piece's device, made when first needed
        capture = split.captured.capture_device
        self.capture_device = torch.device(capture) if capture is not None else None

    def build(self):
        split, k = self.split, self.k
        for node in split.nodes:
            if node.op in ("placeholder", "output", "get_attr") or node in split.input_only:
                continue
            if split.segment[node] != k or (is_cut(node) and split.cuts.index(node) == k):
                continue
            self.env[node] = self._copy(node)
        end = split.cuts[k].args[0] if k < len(split.cuts) else split.loss
        self.graph.output(self.value(end))
        self._drop_unused()
        self.graph.lint()
        return self.graph

    def _drop_unused(self):
        """Values of the segment nothing uses (the other outputs of a
        ModelOutput, say); changes to state (a buffer's update) and module
        calls stay."""
        for node in reversed(list(self.graph.nodes)):
            if node.users or node.op in ("placeholder", "output", "call_module"):
                continue
            if node.op in ("call_function", "call_method") and _in_place(node):
                continue
            self.graph.erase_node(node)

    def value(self, node):
        split = self.split
        if node in self.env:
            return self.env[node]
        if self.k > 0 and node is split.cuts[self.k - 1]:
            return self.activation
        if node.op == "placeholder":
            default = node.args[0] if node.args else None
            self.env[node] = self.graph.call_method("get", (self.inputs, node.target, default))
        elif node.op == "get_attr":
            target = split.name_in[self.k].get(node.target, node.target)
            self.env[node] = self.graph.get_attr(target)
            self.env[node].meta = dict(node.meta)
        elif node in split.input_only:
            self.env[node] = self._copy(node)
        elif _symbolic(node):
            self.env[node] = self._size_here(node)
        else:
            raise AssertionError("node %s of segment %s reached from segment %d"
                                 % (node, split.segment.get(node), self.k))
        return self.env[node]

    def _size_here(self, node):
        """A size computed in another segment (a view's shape, say), taken
        again from a tensor this piece has: the activation or an input whose
        shape holds the same symbol."""
        expr = node.meta["val"].node.expr
        sources = [self.split.cuts[self.k - 1].args[0]] if self.k > 0 else []
        sources += [n for n in self.split.nodes if n.op == "placeholder"]
        for source in sources:
            val = source.meta.get("val")
            for d, size in enumerate(getattr(val, "shape", ())):
                if isinstance(size, torch.SymInt) and size.node.expr == expr:
                    here = self.activation if self.k > 0 and source is sources[0] else self.value(source)
                    return self.graph.call_function(torch.ops.aten.sym_size.int, (here, d))
        refuse("the size '%s' (%s) is computed before %s from a value that does not cross it, and no tensor "
               "after it has that size: compute it after the CutPoint" % (node.name, user_line(node) or "?",
                                                                          self.split.name_of_cut(self.k - 1)), node)

    def _copy(self, node):
        names_device = []
        if self.capture_device is not None:
            map_aggregate((node.args, node.kwargs), lambda a: names_device.append(self._is_capture_device(a)))
        if any(names_device):
            self._device_node()  # before the node that uses it
        copied = self.graph.node_copy(node, self.value)
        if any(names_device):
            copied.args = map_aggregate(copied.args, self._own_device)
            copied.kwargs = map_aggregate(copied.kwargs, self._own_device)
        return copied

    def _is_capture_device(self, arg):
        return isinstance(arg, torch.device) and arg.type == self.capture_device.type

    def _own_device(self, arg):
        return self._device_node() if self._is_capture_device(arg) else arg

    def _device_node(self):
        """The device of this piece's activation (or, in the first piece, of
        its first input): where the piece runs."""
        if self.device is None:
            if self.k > 0:
                source = self.activation
            else:
                first = next(n for n in self.split.nodes if n.op == "placeholder")
                source = self.value(first)
            self.device = self.graph.call_function(getattr, (source, "device"))
        return self.device
