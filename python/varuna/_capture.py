"""Capturing a CutPoint model's forward as one graph (cutpoint.py splits it).

The forward runs once on sample inputs under torch.export (non-strict: the
user's Python runs as written, so shape arithmetic, *args and keyword
arguments, dataclass and ModelOutput returns, asserts and Python control flow
on anything but tensor values all work) and comes back as an ATen-level
torch.fx graph whose parameters and buffers are get_attr nodes named as in
the model. The capture runs on a structural copy of the model on the meta
device: no parameter is copied, a meta-built model needs no values, and every
device the graph names is "meta", which the pieces replace with their own.

Without sample inputs (tools that only look at a model's structure) the
forward is traced symbolically with torch.fx instead, as before; that cannot
follow shape arithmetic on tensors, so the runtime always captures.
"""
import contextlib
import copy
import dataclasses
import functools
import io
import itertools
import logging
import os
import traceback

import torch
import torch.fx

from . import _C

class Captured:
    """A captured forward: the graph module, the output's structure (None:
    the graph returns the value itself) and the device its constants name."""

    def __init__(self, module, out_spec, capture_device):
        self.module = module
        self.graph = module.graph
        self.out_spec = out_spec
        self.capture_device = capture_device


def meta_copy(model):
    """The model's modules and code with every parameter and buffer on the
    meta device (aliases kept: a tensor held under two names stays one)."""
    memo = {}
    for _, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                model.named_buffers(remove_duplicate=False)):
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) \
            if isinstance(t, torch.nn.Parameter) else meta
    return copy.deepcopy(model, memo)


@contextlib.contextmanager
def _mode(model, training):
    before = {m: m.training for m in model.modules()}
    model.train(training)
    try:
        yield
    finally:
        for m, was in before.items():
            m.training = was


@contextlib.contextmanager
def _quiet():
    """Export prints its partial graph and logs symbolic-shape notes on a
    failure; the refusal says what matters."""
    loggers = [logging.getLogger(n) for n in ("torch", "torch._dynamo", "torch.fx.experimental.symbolic_shapes",
                                              "torch.export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def loss_of(output):
    """The loss in what a forward returned: the tensor itself, the "loss"
    of a dict, ModelOutput or dataclass, or the first of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    if dataclasses.is_dataclass(output) or hasattr(output, "loss"):
        return getattr(output, "loss", None)
    if isinstance(output, (tuple, list)) and output:
        return loss_of(output[0])
    return None


def _returning_the_loss(shadow):
    """The copy's forward, returning only the loss (so any output type
    works, and nothing else the forward returns is kept)."""
    original = shadow.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        loss = loss_of(original(*args, **kwargs))
        if not isinstance(loss, torch.Tensor):
            raise _C.ConfigError("the model's forward must return the loss: one tensor, or a dict, ModelOutput, "
                                 "dataclass or tuple holding it (under 'loss', or first)")
        return loss
    shadow.forward = forward


def capture(model, sample_inputs, training=True):
    """The forward of `model` on `sample_inputs` (a dict of tensors, batch
    first), in training or evaluation mode, as a Captured graph. Every
    dimension of every input may vary (torch.export.Dim.AUTO) unless the code
    fixes it. A forward that cannot be captured is a ConfigError naming the
    cause and the line of the model's code where it happened."""
    shadow = meta_copy(model)
    _returning_the_loss(shadow)
    inputs = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in sample_inputs.items()}
    dims = {k: ({d: torch.export.Dim.AUTO for d in range(v.dim())} if isinstance(v, torch.Tensor) else None)
            for k, v in inputs.items()}
    try:
        # Tensors the forward makes without naming a device are made on the
        # meta device too, and so on the piece's device when it runs.
        with _mode(shadow, training), _quiet(), torch.autocast("cpu", enabled=False), torch.device("meta"):
            exported = torch.export.export(shadow, (), inputs, strict=False, dynamic_shapes=dims)
        module = exported.module()
    except _C.ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - any capture failure is the user's to see, explained
        raise _C.ConfigError(explain_failure(error)) from None
    _drop_guards(module)
    return Captured(module, module.graph._codegen.pytree_info.out_spec, torch.device("meta"))


def _drop_guards(module):
    """The exported module checks its inputs' shapes against the sample's
    (_guards_fn); the runtime feeds every piece the shapes it learnt from the
    same samples, and a piece has no such module."""
    for node in list(module.graph.nodes):
        if node.op == "call_module" and node.target.startswith("_guards"):
            module.graph.erase_node(node)
    module.graph.eliminate_dead_code()
    module.recompile()


class _Tracer(torch.fx.Tracer):
    """Symbolic tracing through CutPoints (even ones in a plain list, which fx
    cannot name as submodules): each leaves its cut node."""

    def __init__(self, cutpoint_type):
        super().__init__()
        self.record_stack_traces = True
        self.cutpoint_type = cutpoint_type

    def call_module(self, m, forward, args, kwargs):
        if isinstance(m, self.cutpoint_type):
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)


def trace_symbolically(model, cutpoint_type):
    """The forward traced by torch.fx without data (no sample inputs)."""
    try:
        graph = _Tracer(cutpoint_type).trace(model)
    except Exception as error:  # noqa: BLE001 - any tracing failure is the user's to see
        raise _C.ConfigError("the model's forward could not be traced with torch.fx to split it at its CutPoints "
                             "(%s: %s); give Varuna get_batch_fn's sample inputs, which capture it with "
                             "torch.export instead" % (type(error).__name__, error)) from None
    return Captured(torch.fx.GraphModule(model, graph), None, None)


# --- explaining a failed capture ---------------------------------------------------

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_VARUNA_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep


def _is_library(filename):
    """torch, this package, or the standard library (not packages installed
    beside it: a model's own code may live there, e.g. transformers)."""
    path = os.path.abspath(filename)
    if filename.startswith("<") or path.startswith((_TORCH_DIR, _VARUNA_DIR)):
        return True
    return path.startswith(_STDLIB_DIR) and "-packages" + os.sep not in path


def _user_frame(error):
    """(file, line, code) of the model's code where the capture failed: the
    frame export names ("The following call raised this error"), else the
    innermost frame of the traceback outside torch, varuna and the standard
    library."""
    text = str(error)
    marker = "The following call raised this error:"
    if marker in text:
        lines = text[text.index(marker) + len(marker):].strip().splitlines()
        if lines and lines[0].strip().startswith("File "):
            where = lines[0].strip()
            code = lines[1].strip() if len(lines) > 1 else ""
            try:
                filename = where.split('"')[1]
                line = int(where.split("line ")[1].split(",")[0])
                return filename, line, code
            except (IndexError, ValueError):
                pass
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not _is_library(f.filename)]
    if frames:
        return frames[-1].filename, frames[-1].lineno, (frames[-1].line or "").strip()
    return None


def explain_failure(error):
    name = type(error).__name__
    first = str(error).strip().splitlines()[0] if str(error).strip() else name
    data_dependent = "data-dependent" in str(error) or "DataDependent" in name
    where = _user_frame(error)
    at = " at %s:%d (`%s`)" % where if where else ""
    if data_dependent:
        cause = ("its control flow depends on a tensor's value%s: a branch on a value (if x.sum() > 0, "
                 "x.item(), a loop over a tensor) differs from batch to batch, so the pieces cannot be fixed "
                 "in advance; compute it with tensor operations (torch.where) or give the model as pieces "
                 "(docs/python.md)" % at)
    else:
        cause = "%s: %s%s" % (name, first, at)
    return "the model's forward could not be captured (torch.export, on get_batch_fn's sample inputs) to " \
           "split it at its CutPoints: " + cause
