"""varuna.Varuna: the manual's API over the C++ runtime (varuna._C.Runtime)."""
import atexit
import os
import sys
import traceback
import weakref

import torch

from . import _C
from .cutpoint import split_at_cutpoints
from .optimizer import OptimizerBridge

__all__ = ["Varuna", "StepResult", "get_launch_args", "install_checkpoint_signal_handler", "exit_after_failure"]


def get_launch_args(argv=None):
    """The launcher's arguments (run_varuna, scripts/varuna_launch.py, torchrun)
    from `argv` (default sys.argv; argv[0] is the program) and the
    environment: rank, local_rank, stage_to_rank_map, chunk_size, batch_size
    (the global batch), replica_batch_size (this replica's share: the launch
    contract's --batch-size), stages, replicas, stage, replica, resume_step,
    the rendezvous, and user_args, everything the runtime did not
    recognise."""
    return _C.parse_launch_args(list(sys.argv if argv is None else argv))


def install_checkpoint_signal_handler():
    """SIGUSR1 asks for a checkpoint (run_varuna sends it before a morph): call
    it first thing in the program; the next step() tells every rank."""
    _C.install_checkpoint_signal_handler()


def exit_after_failure(error):
    """Ends a worker after an expected failure: prints it and exits at once with
    its exit code (2 for a ConfigError, 3 for a lost peer, ...), skipping
    destructors that could wait on peers that already left."""
    code = getattr(error, "exit_code", 1)
    if isinstance(error, (_C.Error, _C.ConfigError)):
        print("varuna: %s" % error, file=sys.stderr)
    else:
        traceback.print_exception(error, file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    _C.exit_worker(code)


class _ClosedRuntime:
    def __getattr__(self, name):
        raise RuntimeError("varuna.Varuna.%s: this Varuna was closed" % name)


# Runtimes still open when the program ends are closed before the interpreter
# tears down (which may never run their destructors): rank 0, which hosts the
# job's rendezvous store, then waits for the others to finish.
_open_runtimes = weakref.WeakSet()


@atexit.register
def _close_open_runtimes():
    # An uncaught exception ends the program: leave without waiting (the
    # peers may be blocked on this rank).
    failed = hasattr(sys, "last_value") or getattr(sys, "last_exc", None) is not None
    for model in list(_open_runtimes):
        model.close(failed=failed)


class StepResult:
    """What step() returns: unpacks as (loss, overflow, grad_norm); also
    loss_scale and checkpoint_requested."""

    __slots__ = ("_raw",)

    def __init__(self, raw):
        self._raw = raw

    loss = property(lambda self: self._raw.loss)
    overflow = property(lambda self: self._raw.overflow)
    grad_norm = property(lambda self: self._raw.grad_norm)
    loss_scale = property(lambda self: self._raw.loss_scale)
    checkpoint_requested = property(lambda self: self._raw.checkpoint_requested)

    def __iter__(self):
        return iter((self.loss, self.overflow, self.grad_norm))

    def __repr__(self):
        return "StepResult(loss=%r, overflow=%r, grad_norm=%r)" % tuple(self)


def _check_tied_parameters(model, shared_weights):
    """A Parameter two children of a Sequential hold must be a declared
    shared-weight pair: once its pieces land on different stages each holds
    its own copy, which only a declared pair keeps equal. Checked on the whole
    model, so the answer does not depend on the layout."""
    declared = {frozenset(pair) for pair in shared_weights}
    first_name = {}
    for child_name, child in model.named_children():
        for name, param in child.named_parameters():
            full = "%s.%s" % (child_name, name)
            first = first_name.setdefault(id(param), full)
            if first != full and frozenset((first, full)) not in declared:
                raise _C.ConfigError(
                    "parameters '%s' and '%s' are one tensor (two pieces hold the same Parameter): pass "
                    "shared_weights=[('%s', '%s')] so that it stays one weight when the pieces land on "
                    "different stages" % (first, full, first, full))


def _split_name(names, model, name):
    """The runtime's name of the model's parameter `name` (CutPoint form)."""
    if name not in names or name not in dict(model.named_parameters(remove_duplicate=False)):
        known = [n for n, _ in model.named_parameters()]
        raise _C.ConfigError("shared weight '%s' is not a parameter of the model; it has: %s"
                             % (name, ", ".join(known[:20]) + (", ..." if len(known) > 20 else "")))
    return names[name]


def split_cutpoint_model(model, shared_weights, get_batch_fn, sample_size, init_fn, seed):
    """A CutPoint model's pieces for the runtime: (SplitModel, shared-weight
    pairs in the runtime's names: the declared ones and the model's own
    ties, each once, {runtime name: the model's name}). The forward is
    captured on get_batch_fn's samples (at least 2, so that the batch size is
    not taken as fixed)."""
    samples = dict(get_batch_fn(max(2, int(sample_size)), torch.device("cpu")))
    split = split_at_cutpoints(model, init_fn, int(seed), sample_inputs=samples)
    pairs, seen = [], set()
    for a, b in [tuple(_split_name(split.names, model, n) for n in pair) for pair in shared_weights] + split.ties:
        if a != b and frozenset((a, b)) not in seen:
            seen.add(frozenset((a, b)))
            pairs.append((a, b))
    return split, pairs, split.model_names


def _pieces_of(model):
    """[(name, factory, parameter count)] from the accepted forms of `model`."""
    if isinstance(model, torch.nn.Sequential):
        # Built already (by every rank): the children are the pieces.
        return [(name, (lambda child=child: child), sum(p.numel() for p in child.parameters()))
                for name, child in model.named_children()]
    pieces = []
    for entry in model:
        if len(entry) == 2:
            name, factory = entry
            count = -1
        else:
            name, factory, count = entry
        if not callable(factory):
            raise TypeError("piece '%s': expected a factory (a callable returning a torch.nn.Module)" % name)
        pieces.append((str(name), factory, int(count)))
    return pieces


def _device_of(device, local_rank, comm_backend):
    """The manual's device: a CUDA index, -1/None for the CPU, a torch device
    string, or "cuda" alone: this worker's GPU by its local rank (its own
    with NCCL; with comm_backend="gloo" the host's GPUs are shared)."""
    if device is None or device == -1:
        return "cpu"
    if isinstance(device, int):
        return "cuda:%d" % device
    if str(device) == "cuda":
        return _C.cuda_device_for_local_rank(local_rank, comm_backend)
    return str(device)


class Varuna:
    """One rank's share of a model trained as P pipeline stages x D replicas.

    model: a torch.nn.Module whose forward(**inputs) returns the loss, with
      varuna.CutPoint calls marking where it may be cut (the manual's form:
      cutpoint.py has the rules; only this rank's pieces are kept), or a
      torch.nn.Sequential whose children are the pieces, or a list of
      (name, factory[, parameter count]) where each factory returns a
      torch.nn.Module with forward(activation, inputs) (activation None for the
      first piece; the last returns the scalar loss). Given each piece's
      parameter count, factories are called only by the ranks that own the
      piece (without it, every rank builds each piece once to count), each
      right after torch.manual_seed(seed + index), so initial weights do not
      depend on the layout. Parameters with requires_grad=False are state
      like buffers: checkpointed, identical on every replica, not trained.
    stage_to_rank_map, batch_size (the global batch: all replicas together),
      chunk_size (micro-batch), local_rank: None takes them from the
      launcher (get_launch_args(); its batch_size is global too); a
      batch_size other than the launcher's is refused.
    get_batch_fn(size, device): sample inputs (a dict of tensors, batch first).
    fp16 / precision: "fp32" (default), "bf16" or "fp16" (with loss scaling).
    device: None/-1 for the CPU, a CUDA index, a torch device string, or
      "cuda": this worker's GPU by its local rank.
    comm_backend: "auto" (NCCL on CUDA, Gloo on the CPU), "gloo" (also for
      CUDA tensors: several ranks may share one GPU) or "nccl".
    on_nonfinite: what an fp32/bf16 step with non-finite gradients does:
      "skip" (default; the step's exchange is read before the optimizer
      runs) or "stop" (the optimizer is queued first, faster on GPUs where
      it is many small kernels; such a step then raises varuna.Error, exit
      code 1). fp16 always skips.
    host_memory: "fast" (default: the C library's allocator as it is) or
      "compact" (host blocks of 4 MiB and more are returned to the system
      when freed: a CPU rank's peak memory is what is live, at some CPU step
      time; process-wide; docs/python.md "Memory per rank").
    trace_dir: each rank writes what it did when in every step (tasks, waits
      on neighbours, messages, all-reduces, update) as Chrome trace events
      to trace_dir/rank<r>_trace.json; scripts/pipeline_trace.py merges them
      and tells the schedule's bubble from the rest (docs/profile.md).
    shared_weights: [(name, name)] of parameters that hold one weight.
    init_fn(name, module): for a CutPoint model built on the meta device (the
      way for big models: no rank ever holds all of it), how each submodule
      holding parameters or buffers of its own is initialised once its piece
      is materialised, under a seed from `seed` and its name; default: its
      reset_parameters(). varuna.initialize(model, init_fn, seed) gives a
      normally built model the same weights.
    """

    def __init__(self, model, stage_to_rank_map=None, get_batch_fn=None, batch_size=None, chunk_size=None,
                 fp16=False, local_rank=None, device=None, shared_weights=None, *, precision=None,
                 schedule="varuna", seed=0, piece_costs=None, bucket_bytes=None, peer_timeout_s=None,
                 launch_args=None, global_store=None, keep_checkpoints=None, init_fn=None, comm_backend="auto",
                 on_nonfinite="skip", host_memory="fast", trace_dir=None):
        if get_batch_fn is None:
            raise ValueError("Varuna: get_batch_fn is required (sample inputs teach the runtime the shapes "
                             "that cross each cut)")
        args = launch_args if launch_args is not None else get_launch_args()
        options = _C.Options()
        options.apply_launch_args(args)
        if stage_to_rank_map is not None:
            options.stage_to_rank_map = stage_to_rank_map
        if local_rank is not None and local_rank >= 0:
            options.local_rank = local_rank
        # The global batch; None takes the launcher's (its --batch_size), and
        # the runtime refuses a value other than the launcher's.
        options.batch_size = int(batch_size) if batch_size is not None else 0
        options.chunk_size = int(chunk_size if chunk_size is not None else args.chunk_size)
        options.precision = precision or ("fp16" if fp16 else "fp32")
        options.comm_backend = comm_backend
        options.device = _device_of(device, options.local_rank, comm_backend)
        options.schedule = schedule
        options.on_nonfinite = on_nonfinite
        options.host_memory = host_memory
        if trace_dir:
            options.trace_dir = str(trace_dir)
        if bucket_bytes is not None:
            options.bucket_bytes = int(bucket_bytes)
        if peer_timeout_s is not None:
            options.peer_timeout_s = float(peer_timeout_s)
        if global_store is not None:
            options.global_store = global_store
        if keep_checkpoints is not None:
            options.keep_checkpoints = int(keep_checkpoints)
        shared_weights = [tuple(p) for p in (shared_weights or [])]
        self._split = None
        self._original_names = {}  # the runtime's names -> the model's (CutPoint form)
        if isinstance(model, torch.nn.Module) and not isinstance(model, torch.nn.Sequential):
            self._split, shared_weights, self._original_names = split_cutpoint_model(
                model, shared_weights, get_batch_fn, options.chunk_size, init_fn, seed)
            pieces = self._split.pieces
        else:
            if isinstance(model, torch.nn.Sequential):
                _check_tied_parameters(model, shared_weights)
            pieces = _pieces_of(model)
        del model  # the CutPoint form: this rank keeps only the pieces it owns
        options.set_pieces(pieces, shared_weights, int(seed), [float(c) for c in (piece_costs or [])])

        def get_batch(size, device_name):
            return dict(get_batch_fn(size, torch.device(device_name)))
        options.set_get_batch(get_batch)
        self._runtime = _C.Runtime(options)
        # The runtime took the job token and scrubbed it from the C
        # environment; Python's copy goes too (docs/deployment.md, "Security").
        os.environ.pop("VARUNA_JOB_TOKEN", None)
        os.environ.pop("VARUNA_JOB_TOKEN_FD", None)  # read and closed: not for this program's children
        if self._split is not None:
            self._split.release()
        self._bridge = None
        _open_runtimes.add(self)

    def close(self, failed=False):
        """Leaves the job (at the end of training; also done at exit): waits
        for background checkpoints, and on rank 0, which hosts the job's
        rendezvous store, for the other ranks to finish (a minute at most;
        not with failed=True, nor after an uncaught exception); then frees
        the runtime. The object is unusable afterwards."""
        runtime, self._runtime = self._runtime, _ClosedRuntime()
        _open_runtimes.discard(self)
        if failed and not isinstance(runtime, _ClosedRuntime):
            runtime.abandon()
        del runtime

    # --- parameters --------------------------------------------------------------
    def parameters(self):
        """This stage's parameters (the Python modules' own), for the optimizer."""
        return self._runtime.parameters()

    def named_parameters(self):
        """(name, parameter) of this stage, named as in the model given (the
        runtime's own names, "<piece>.<path>", where pieces were given); a
        tensor held under two names (a declared tie) once, under the first."""
        out, seen = [], set()
        for name, p in self._runtime.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((self._original_names.get(name, name), p))
        return out

    def named_buffers(self):
        """(name, buffer) of this stage, named as parameters are; a buffer
        several of its pieces use (a rotary table), once."""
        out, seen = [], set()
        for name, b in self._runtime.named_buffers():
            if id(b) not in seen:
                seen.add(id(b))
                out.append((self._original_names.get(name, name), b))
        return out

    # --- training ------------------------------------------------------------------
    def set_optimizer(self, optimizer, loss_scale="dynamic", init_loss_scale=1048576, min_loss_scale=1.0,
                      loss_scale_growth_interval=1000):
        """Connects any torch.optim optimizer over parameters(); its state is
        checkpointed per parameter name. The loss scale applies to fp16: a
        dynamic one halves on an overflow and doubles after
        `loss_scale_growth_interval` clean steps."""
        scale = _C.LossScaleOptions()
        if loss_scale == "dynamic":
            scale.dynamic = True
            scale.initial_scale = float(init_loss_scale)
        else:
            scale.dynamic = False
            scale.initial_scale = float(loss_scale)
        scale.min_scale = float(min_loss_scale)
        scale.growth_interval = int(loss_scale_growth_interval)
        self._bridge = OptimizerBridge(optimizer)
        self._runtime.set_optimizer(self._bridge, scale)

    def step(self, inputs, clip_grad_max_norm=None):
        """One step over this replica's share of the global batch (every stage
        of a replica gets the same inputs). Call it on every rank."""
        return StepResult(self._runtime.step(dict(inputs), clip_grad_max_norm))

    def evaluate(self, inputs):
        """Mean loss over every replica's inputs, without gradients. A
        CutPoint model's forward is captured in evaluation mode the first
        time (a few seconds)."""
        if self._split is not None:
            self._split.prepare_evaluation()
        return self._runtime.evaluate(dict(inputs))

    def exit_if_checkpoint_requested(self, result):
        """After every step under run_varuna: writes the on-demand checkpoint and
        exits with EXIT_CHECKPOINTED (75) when a checkpoint was asked for."""
        raw = result._raw if isinstance(result, StepResult) else result
        if raw.checkpoint_requested:  # the exit skips Python's own buffers
            sys.stdout.flush()
            sys.stderr.flush()
        self._runtime.exit_if_checkpoint_requested(raw)

    # --- checkpoints ----------------------------------------------------------------
    def checkpoint(self, global_store, step=None, tempdir=None, shard=False, on_demand=False):
        return self._runtime.checkpoint(global_store, step, tempdir or "", shard, on_demand)

    def load_checkpoint(self, global_store, iteration, check_complete=True):
        return self._runtime.load_checkpoint(global_store, int(iteration), check_complete)

    def load_latest_checkpoint(self, global_store, at_most=None):
        return self._runtime.load_latest_checkpoint(global_store, at_most)

    def wait_for_checkpoints(self):
        self._runtime.wait_for_checkpoints()

    # --- where this rank is ------------------------------------------------------------
    rank = property(lambda self: self._runtime.rank)
    stage = property(lambda self: self._runtime.stage)
    replica = property(lambda self: self._runtime.replica)
    num_stages = property(lambda self: self._runtime.num_stages)
    num_chunks = property(lambda self: self._runtime.num_chunks)
    owned_pieces = property(lambda self: self._runtime.owned_pieces)
    num_replicas = property(lambda self: self._runtime.num_replicas)
    is_last_stage = property(lambda self: self._runtime.is_last_stage)
    steps_done = property(lambda self: self._runtime.steps_done)
    samples_seen = property(lambda self: self._runtime.samples_seen)
    loss_scale = property(lambda self: self._runtime.loss_scale)
