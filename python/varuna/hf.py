"""Hugging Face transformers models in the manual's CutPoint form
(docs/python.md, "Hugging Face models").

    model = transformers.AutoModelForCausalLM.from_config(config)   # or from_pretrained
    varuna.hf.cut_between_blocks(model)                             # a CutPoint before every block but the first
    runtime = varuna.Varuna(model, get_batch_fn=..., batch_size=...)

The model's own forward runs (its loss included: a batch is what the model
takes, e.g. input_ids and labels); its tied embeddings stay tied (each piece
holding a use of them keeps its own copy, kept equal as a shared-weight pair);
nothing here depends on transformers, which is imported by the user.
"""
import functools

import torch

from . import _C
from .cutpoint import CutPoint

__all__ = ["cut_between_blocks", "find_blocks", "init_fn"]

# Where common architectures keep their stack of blocks.
_KNOWN_BLOCKS = ("transformer.h", "model.layers", "model.decoder.layers", "gpt_neox.layers", "transformer.blocks",
                 "bert.encoder.layer", "roberta.encoder.layer", "deberta.encoder.layer", "encoder.layer", "layers",
                 "h", "blocks")


def find_blocks(model):
    """The model's stack of transformer blocks: a torch.nn.ModuleList at one
    of the usual places (transformer.h, model.layers, bert.encoder.layer,
    ...), else the longest ModuleList whose children are all of one class."""
    for path in _KNOWN_BLOCKS:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(found, torch.nn.ModuleList) and len(found) > 0:
            return found
    candidates = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1 and
                  len({type(c) for c in m}) == 1]
    if not candidates:
        raise _C.ConfigError("%s has no stack of blocks (a ModuleList of modules of one class) to cut between: "
                             "pass blocks= to cut_between_blocks, or place varuna.CutPoint calls in the model's "
                             "forward yourself" % type(model).__name__)
    return max(candidates, key=len)


def _cut_first_argument(cutpoint, module, args, kwargs):
    """Forward pre-hook: the block's input (its first argument, or
    hidden_states) passes through the CutPoint."""
    if args:
        return (cutpoint(args[0]),) + tuple(args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, dict(kwargs, hidden_states=cutpoint(kwargs["hidden_states"]))
    raise _C.ConfigError("%s was called without a positional input or hidden_states: cut_between_blocks cannot "
                         "tell which argument crosses the CutPoint" % type(module).__name__)


def cut_between_blocks(model, blocks=None):
    """Puts a varuna.CutPoint before every block but the first of `model`
    (blocks: the ModuleList to cut between; default find_blocks(model)), so
    that the model's unchanged forward can be split between any two blocks,
    and turns its key-value cache off (config.use_cache = False: training
    keeps none, and a cache object cannot cross a cut). The CutPoints are in
    model.varuna_cutpoints. Returns the model."""
    blocks = find_blocks(model) if blocks is None else blocks
    if len(blocks) < 2:
        raise _C.ConfigError("cut_between_blocks: %s has %d block(s); there is nothing to cut between"
                             % (type(model).__name__, len(blocks)))
    if getattr(model, "varuna_cutpoints", None):
        raise _C.ConfigError("cut_between_blocks was already applied to this model")
    cutpoints = [CutPoint() for _ in range(len(blocks) - 1)]
    model.varuna_cutpoints = cutpoints  # a plain list: found by find_cutpoints, not a submodule
    for cutpoint, block in zip(cutpoints, list(blocks)[1:]):
        block.register_forward_pre_hook(functools.partial(_cut_first_argument, cutpoint), with_kwargs=True)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    return model


def init_fn(model):
    """An init_fn for Varuna (a model built on the meta device) that
    initialises each submodule as the Hugging Face model itself does
    (its _init_weights)."""
    def initialise(name, module):
        model._init_weights(module)
    return initialise
