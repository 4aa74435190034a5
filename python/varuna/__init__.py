"""Varuna for PyTorch: elastic pipeline x data-parallel training on machines
that come and go, on the same C++ engine as run_varuna's C++ workers.

    import varuna
    model = varuna.Varuna(model, stage_to_rank_map, get_batch_fn, batch_size, chunk_size)  # CutPoints inside
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.set_optimizer(optimizer)
    for inputs in batches:
        loss, overflow, grad_norm = model.step(inputs)

docs/python.md has the whole API; what is not here is in the C++ runtime
(worker/include/varuna/worker/varuna.h), which this package drives.
"""
from ._C import ConfigError, Error, EXIT_CHECKPOINTED  # noqa: F401
from . import hf  # noqa: F401  (varuna.hf: Hugging Face models in the CutPoint form)
from .cutpoint import CutPoint, initialize  # noqa: F401
from .optimizer import OptimizerBridge  # noqa: F401
from .profiler import Profiler  # noqa: F401
from .runtime import StepResult, Varuna, exit_after_failure, get_launch_args, install_checkpoint_signal_handler  # noqa: F401

__all__ = ["Varuna", "CutPoint", "initialize", "Profiler", "StepResult", "ConfigError", "Error", "EXIT_CHECKPOINTED", "get_launch_args",
           "install_checkpoint_signal_handler", "exit_after_failure", "OptimizerBridge"]
