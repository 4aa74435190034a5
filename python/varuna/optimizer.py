"""The bridge between any torch.optim optimizer and the runtime's checkpoints.

The C++ runtime calls it (varuna._C, PythonOptimizer) to step the optimizer
and to save and restore its state per parameter, keyed by the parameter's full
name ("<param>/<key>"), never by address, so a checkpoint loads under any
partition and in a C++ job of the same model (docs/checkpoints.md). The names
are torch.optim's own state keys, which are also what the C++ side writes for
SGD, Adam and AdamW; "step" is kept as the C++ side keeps it (an int64 tensor
of one element) and given back to torch.optim as the float tensor it uses.
"""
import json
import numbers

import torch
from torch.optim import optimizer as _torch_optimizer

__all__ = ["OptimizerBridge"]

_SCALAR_KEYS = ("step",)
# State that has the parameter's shape (checked on load); other keys may not
# (e.g. Adafactor's row and column factors).
_PARAM_SHAPED_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "sum",
                      "grad_avg", "acc_delta", "prev", "ax", "mu_product")


def _scalar_dtype(fused):
    getter = getattr(_torch_optimizer, "_get_scalar_dtype", None)
    return getter(is_fused=fused) if getter else torch.float32


def _saved(key, value):
    """One state entry as the tensor a checkpoint holds (None: not saved)."""
    if key in _SCALAR_KEYS:
        return torch.tensor([int(value.item() if torch.is_tensor(value) else value)], dtype=torch.long)
    if torch.is_tensor(value):
        return value.detach()
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        return None  # not tensor state (e.g. a None momentum buffer)
    return torch.tensor(value)


def _restored(key, tensor, param, group):
    if key in _SCALAR_KEYS:
        # As torch.optim's own load_state_dict puts it: on the parameter's
        # device for a capturable or fused optimizer (its step runs there),
        # on the CPU otherwise.
        fused, capturable = bool(group.get("fused")), bool(group.get("capturable"))
        device = param.device if fused or capturable else torch.device("cpu")
        return torch.tensor(float(tensor.reshape(-1)[0].item()), dtype=_scalar_dtype(fused), device=device)
    return tensor.to(param.device)


def _jsonable(value):
    if isinstance(value, bool) or value is None or isinstance(value, (int, float, str)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_jsonable(v) for v in value)
    return False


class OptimizerBridge:
    """`optimizer` over the runtime's stage: what PythonOptimizer calls."""

    def __init__(self, optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("set_optimizer: expected a torch.optim.Optimizer, got %s" % type(optimizer).__name__)
        self.optimizer = optimizer
        self.type = type(optimizer).__name__.lower()

    def step(self):
        self.optimizer.step()

    def state(self, params):
        out = []
        for name, param in params:
            for key, value in sorted(self.optimizer.state.get(param, {}).items()):
                tensor = _saved(key, value)
                if tensor is not None:
                    out.append(("%s/%s" % (name, key), tensor))
        return out

    def decode_state(self, params, saved, source):
        """Checks `saved` (name -> tensor) for `params`; returns what applies it."""
        decoded, cleared = [], []
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        for name, param in params:
            prefix = name + "/"
            entries = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
            if not entries:
                cleared.append(param)
                continue
            bad = [k for k, v in entries.items() if k in _PARAM_SHAPED_KEYS and v.shape != param.shape]
            if bad:
                raise ValueError("'%s': the optimizer state '%s' of '%s' does not have the parameter's shape "
                                 "(was it written by another model?)" % (source, bad[0], name))
            group = group_of.get(id(param), {})
            decoded.append((param, {k: _restored(k, v, param, group) for k, v in entries.items()}))

        def apply():
            for param in cleared:
                self.optimizer.state.pop(param, None)
            for param, state in decoded:
                self.optimizer.state[param] = state
        return apply

    def settings(self):
        group = self.optimizer.param_groups[0]
        out = {"type": self.type}
        for key, value in group.items():
            if key == "params":
                continue
            if torch.is_tensor(value) and value.numel() == 1:
                value = value.item()
            if _jsonable(value):
                out[key] = list(value) if isinstance(value, tuple) else value
        if isinstance(group.get("betas"), (tuple, list)) and len(group["betas"]) == 2:
            out["beta1"], out["beta2"] = float(group["betas"][0]), float(group["betas"][1])  # the C++ names
        # Every group's learning rate (a schedule may have changed them; groups
        # may differ, e.g. no weight decay or per-layer rates).
        out["lr_groups"] = [float(g["lr"].item() if torch.is_tensor(g["lr"]) else g["lr"])
                            for g in self.optimizer.param_groups]
        return out

    def settings_json(self):
        return json.dumps(self.settings())

    def check_settings_json(self, text):
        saved = json.loads(text) if text else None
        kind = saved.get("type", "") if isinstance(saved, dict) else ""
        if kind != self.type:
            raise ValueError("the checkpoint was written with optimizer '%s' but this job uses '%s'" % (kind, self.type))
        if not isinstance(saved.get("lr"), numbers.Number):
            raise ValueError("the checkpoint's optimizer settings have no lr")

    def apply_settings_json(self, text):
        # The learning rates may have been scheduled: they are the values to
        # carry over, per group when the checkpoint has as many groups (one
        # written by the C++ side has one rate for all).
        saved = json.loads(text)
        groups = self.optimizer.param_groups
        rates = saved.get("lr_groups")
        if not isinstance(rates, list) or len(rates) != len(groups):
            rates = [saved["lr"]] * len(groups)
        for group, lr in zip(groups, rates):
            if torch.is_tensor(group["lr"]):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
