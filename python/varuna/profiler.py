"""varuna.Profiler: the manual's Profiler over the C++ one (varuna._C.Profiler,
worker/include/varuna/worker/profiler.h). It measures the model's pieces and
this job's links and writes the profile.json that run_varuna --profile plans
with (docs/profile.md has the file and what is measured; docs/python.md the
three steps).
"""
import json

import torch

from . import _C
from .runtime import _check_tied_parameters, _device_of, _pieces_of, get_launch_args, split_cutpoint_model

__all__ = ["Profiler"]

# What the C++ Profiler times for a torch.optim class (its lower-case name):
# its own Adam, AdamW or SGD with momentum. Others get the one whose state per
# parameter is closest: two tensors (moments) -> adam, one -> sgd. The timed
# step and the state size (8 or 4 bytes per parameter) are what AutoConfig uses.
_OPTIMIZER_KIND = {
    "adam": "adam", "adamw": "adamw", "sgd": "sgd",
    "nadam": "adam", "radam": "adam", "adamax": "adam", "adadelta": "adam", "rprop": "adam", "sparseadam": "adam",
    "adagrad": "sgd", "rmsprop": "sgd", "asgd": "sgd",
}


def optimizer_kind(optimizer):
    """What the C++ Profiler times for `optimizer` (a torch.optim optimizer,
    its class, or its name): "adam", "adamw" or "sgd"."""
    if isinstance(optimizer, str):
        name = optimizer.lower()
    else:
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        name = cls.__name__.lower()
    return _OPTIMIZER_KIND.get(name, "adam")


class Profiler:
    """Profiles a model for AutoConfig: run it on every worker of the profiling
    job (started like training workers: run_varuna, scripts/varuna_launch.py,
    torchrun; any number of processes share the pieces), in three steps:

        profiler = varuna.Profiler(model, get_batch_fn, out_folder="prof")
        profiler.set_optimizer(optimizer)        # the type is what counts
        profile = profiler.profile_all([1, 2, 4, 8])   # micro-batch sizes

    Rank 0 writes <out_folder>/profile.json (the C++ Profiler's file, for
    `run_varuna --profile`) and profile_all returns it there as a dict; the
    other ranks get None once it is written.

    model: as varuna.Varuna takes it: an nn.Module with CutPoints (also one
      built on the meta device, with init_fn), a Sequential of pieces, or a
      list of (name, factory[, parameter count]). The pieces, their names and
      seeds are the ones Varuna trains, so the profile matches the training
      job's model. The timed optimizer steps change the weights of a model
      built normally: profile in a separate run (or on a copy).
    get_batch_fn(size, device): sample inputs of `size` samples.
    device: None or -1 for the CPU, a CUDA index (the manual's local_rank),
      or a torch device string.
    gpus_per_node: accepted for the manual's signature; unused (a peer is on
      the same host when its VARUNA_HOST, else its host name, is rank 0's).
    fp16 / precision: "fp32" (default), "bf16" or "fp16", as in training.
    out_folder: folder of profile.json (rank 0 needs it).
    pstages_to_profile: the pieces to measure, by index or name; None: all.
    from_cache: skip every (piece, size) and link the existing profile has
      (implies add_to_existing).
    add_to_existing: add this run's figures to the existing profile (refused
      if it is of another model, device or precision); new figures replace
      old ones for the same (piece, size).
    Keyword-only: shared_weights, seed, init_fn (as Varuna's), warmup and
      repetitions per figure, profile_communication, comm_repetitions,
      max_comm_bytes, peer_timeout_s, launch_args (default
      get_launch_args()), comm_backend (as Varuna's).
    """

    def __init__(self, model, get_batch_fn, device=-1, gpus_per_node=None, fp16=False, out_folder="profiles",
                 pstages_to_profile=None, from_cache=False, add_to_existing=False, *, precision=None,
                 shared_weights=None, seed=0, init_fn=None, warmup=None, repetitions=None,
                 profile_communication=True, comm_repetitions=None, max_comm_bytes=None, peer_timeout_s=None,
                 launch_args=None, comm_backend="auto"):
        del gpus_per_node  # the host identity decides same-host links
        if get_batch_fn is None:
            raise ValueError("Profiler: get_batch_fn is required (sample inputs of each micro-batch size)")
        args = launch_args if launch_args is not None else get_launch_args()
        options = _C.ProfilerOptions()
        options.apply_launch_args(args)
        options.output_dir = str(out_folder) if out_folder is not None else ""
        options.precision = precision or ("fp16" if fp16 else "fp32")
        options.comm_backend = comm_backend
        options.device = _device_of(device, args.local_rank, comm_backend)
        options.add_to_existing = bool(add_to_existing)
        options.reuse_cached = bool(from_cache)
        if pstages_to_profile is not None:
            options.pieces = [str(p) for p in pstages_to_profile]
        if warmup is not None:
            options.warmup = int(warmup)
        if repetitions is not None:
            options.repetitions = int(repetitions)
        options.profile_communication = bool(profile_communication)
        if comm_repetitions is not None:
            options.comm_repetitions = int(comm_repetitions)
        if max_comm_bytes is not None:
            options.max_comm_bytes = int(max_comm_bytes)
        if peer_timeout_s is not None:
            options.peer_timeout_s = float(peer_timeout_s)
        self._options = options
        self._rank = args.rank

        shared_weights = [tuple(p) for p in (shared_weights or [])]
        if isinstance(model, torch.nn.Module) and not isinstance(model, torch.nn.Sequential):
            # The pieces' factories keep the model: profile_all builds the
            # pieces from it (one at a time), as often as it is called.
            split, shared_weights, _ = split_cutpoint_model(model, shared_weights, get_batch_fn, 2, init_fn, seed)
            pieces = split.pieces
        else:
            if isinstance(model, torch.nn.Sequential):
                _check_tied_parameters(model, shared_weights)
            pieces = _pieces_of(model)
        self._pieces, self._shared, self._seed = pieces, shared_weights, int(seed)

        def get_batch(size, device_name):
            return dict(get_batch_fn(size, torch.device(device_name)))
        self._get_batch = get_batch
        self.optimizer_kind = "adam"  # the C++ Profiler's default until set_optimizer

    @property
    def piece_names(self):
        """The pieces' names, as in the profile and the training job."""
        return [name for name, _, _ in self._pieces]

    def set_optimizer(self, optimizer, amp_opt_level=None, loss_scale="dynamic", init_loss_scale=1048576,
                      min_loss_scale=None):
        """The optimizer training will use: a torch.optim optimizer, its class,
        or "adam" / "adamw" / "sgd". The C++ Profiler times its own Adam,
        AdamW or SGD (with momentum) step over each piece's parameters;
        another torch.optim class is timed as the closest of those (adam for
        two state tensors per parameter, sgd for one). The loss-scale
        arguments are the manual's and do not change what is measured."""
        del amp_opt_level, loss_scale, init_loss_scale, min_loss_scale
        self.optimizer_kind = optimizer_kind(optimizer)
        self._options.optimizer = self.optimizer_kind

    def profile_all(self, microbatch_sizes):
        """Measures every chosen piece at each micro-batch size in
        `microbatch_sizes` (and the links between the ranks), on every rank;
        rank 0 writes <out_folder>/profile.json and returns the profile as a
        dict, the other ranks return None once it is written. Raises ConfigError
        (bad options, an existing profile of another model: on every rank) or
        varuna.Error (a lost peer)."""
        if isinstance(microbatch_sizes, int):
            microbatch_sizes = [microbatch_sizes]
        self._options.micro_batch_sizes = [int(b) for b in microbatch_sizes]
        profiler = _C.Profiler(self._pieces, self._shared, self._seed, self._get_batch, self._options)
        try:
            text = profiler.run()
        finally:
            del profiler  # its process group, now: a later call makes its own
        return json.loads(text) if self._rank == 0 else None

    def model_fingerprint(self):
        """The fingerprint profile.json carries for this model (piece names and
        parameter shapes; builds each piece once)."""
        return _C.model_fingerprint(self._pieces, self._shared, self._seed)
