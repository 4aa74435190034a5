"""The modules the runtime runs as pieces of a CutPoint model (cutpoint.py):
one torch.fx GraphModule per piece over the model's own parameters and
buffers, named as in the model.

A piece runs the training-mode graph; evaluation (Varuna.evaluate) needs the
forward captured in evaluation mode (dropout off, BatchNorm on its running
statistics), which SplitModel.prepare_evaluation captures once, on first use,
and installs in every piece built so far.
"""
import itertools
import types

import torch
import torch.fx

from . import _C


def _resolve(root, target):
    """The object at dotted path `target` of `root`, or None."""
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _owner_and_field(root, target):
    path, _, field = target.rpartition(".")
    try:
        return (root.get_submodule(path) if path else root), field
    except AttributeError:
        return None, field


class PieceBuilder:
    """Builds piece k's module from the model (`root`) and the captured
    graph's own attributes (constants export lifted, modules of higher-order
    operations): parameters and buffers are the model's objects (the first
    name of a tie) or copies (its other names, so that each piece holds its
    own copy); buffers keep their persistence, constants are not persistent."""

    def __init__(self, split, graphs):
        self.split = split
        self.graphs = graphs  # piece k's training graph
        self.second_names = {b for _, b in split.ties}

    def build(self, root, k, class_name):
        graph = self.graphs[k]
        attrs = {}
        for node in graph.nodes:
            if node.op in ("get_attr", "call_module") and node.target not in attrs:
                attrs[node.target] = self._attribute(root, node.target)
        piece = torch.fx.GraphModule(attrs, graph, class_name=class_name)
        self._set_persistence(root, piece, attrs)
        _dispatch_on_mode(piece)
        return piece

    def _attribute(self, root, target):
        obj = _resolve(root, target)
        if obj is None:
            obj = _resolve(self.split.captured.module, target)  # a constant of the capture
        if obj is None:
            raise _C.ConfigError("the captured forward uses '%s', which the model does not hold" % target)
        if target in self.second_names and isinstance(obj, torch.nn.Parameter):
            obj = torch.nn.Parameter(obj.detach().clone(), requires_grad=obj.requires_grad)
        return obj

    @staticmethod
    def _set_persistence(root, piece, attrs):
        for target, obj in attrs.items():
            if not isinstance(obj, torch.Tensor) or isinstance(obj, torch.nn.Parameter):
                continue
            owner, field = _owner_and_field(root, target)
            persistent = owner is not None and field in owner._buffers and \
                field not in owner._non_persistent_buffers_set
            mine, _ = _owner_and_field(piece, target)
            mine.register_buffer(field, mine._buffers[field], persistent=persistent)


def _dispatch_on_mode(piece):
    """The piece runs its training graph, or in evaluation mode the
    evaluation graph installed by install_evaluation()."""
    train_forward = type(piece).forward

    def forward(self, activation, inputs):
        if self.training:
            return train_forward(self, activation, inputs)
        evaluate = self.__dict__.get("_varuna_eval_forward")
        if evaluate is None:
            raise RuntimeError("a CutPoint piece ran in evaluation mode before its evaluation graph was "
                               "captured (Varuna.evaluate captures it)")
        return evaluate(self, activation, inputs)

    piece.forward = types.MethodType(forward, piece)


def install_evaluation(piece, graph, constants_from):
    """Gives `piece` the forward of `graph` (same attribute names) for
    evaluation mode; attributes only that graph uses (its own constants) are
    added, not persistent."""
    for node in graph.nodes:
        if node.op == "get_attr" and _resolve(piece, node.target) is None:
            obj = _resolve(constants_from, node.target)
            if not isinstance(obj, torch.Tensor) or isinstance(obj, torch.nn.Parameter):
                raise _C.ConfigError("in evaluation mode the model's forward uses '%s', which it does not use "
                                     "in training mode: a piece cannot hold it" % node.target)
            path, _, field = node.target.rpartition(".")
            owner = piece
            for part in filter(None, path.split(".")):
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_buffer(field, obj.to(_device_of(piece)), persistent=False)
    # The generated forward reads self.<path> at each call: the piece's
    # attributes as they are now (moved to the device, say).
    code_holder = torch.fx.GraphModule(piece, graph)
    piece.__dict__["_varuna_eval_forward"] = type(code_holder).forward


def _device_of(module):
    for t in itertools.chain(module.parameters(), module.buffers()):
        return t.device
    return torch.device("cpu")


def materialise(root, piece, rebuild, init_fn, seed, initialize):
    """Piece k of a meta-built model with values: the model's own submodules
    that hold the piece's tensors (their classes, their reset_parameters) are
    materialised on the CPU and initialised as initialize() would, then the
    piece is built again over them (rebuild(root))."""
    owners = {name.rpartition(".")[0] for name, _ in
              itertools.chain(piece.named_parameters(remove_duplicate=False),
                              piece.named_buffers(remove_duplicate=False))}
    for path in owners:
        module = root.get_submodule(path)
        if any(t.is_meta for t in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))):
            module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        initialize(root, init_fn, seed, only=owners)
    piece = rebuild(root)
    for name, tensor in itertools.chain(piece.named_parameters(), piece.named_buffers()):
        if tensor.is_meta:
            raise _C.ConfigError("'%s' is a plain tensor attribute of a model built on the meta device: it has "
                                 "no values; register it as a buffer (register_buffer) so that it is "
                                 "materialised and initialised with its module" % name)
    return piece
