"""cunorm for PyTorch models: the ops as registered torch operators, and
drop-in ``torch.nn`` norm layers.

The functions here take and return torch tensors and run as operators of
the ``cunorm`` torch library (``torch.ops.cunorm.*``, defined in
cunorm/torch/_library.py): ``torch.compile`` treats them as opaque ops
(described to it by their fake implementations, which give each output's
shape, dtype and strides) instead of tracing into CuPy or breaking the graph.
The top-level ``cunorm.*`` ops (and the modules below) route torch tensors
here by themselves when autograd or dynamo needs it; in plain eager
inference they take the shorter direct path, without torch's operator
dispatch (docs/torch.md, "Cost per call").

The modules (cunorm/torch/_layers.py) subclass their ``torch.nn``
counterparts and replace only ``forward``: the constructor arguments,
parameters, buffers, ``state_dict`` keys and ``repr`` are torch's own, so a
checkpoint loads into either. ``replace_norms(model)`` (cunorm/torch/_zoo.py)
swaps a model's norm layers, torch.nn's, timm's and transformers', for
cunorm's in place.

Every op is differentiable: its autograd formula is cunorm's backward
pass (cunorm.backward), itself a registered operator
(``torch.ops.cunorm.*_backward``), so ``torch.compile`` traces training
steps through both. The forward operators return their statistics when
autograd records them (the functions and layers here ask for them and drop
them from what they return); the statistics outputs are not
differentiated through. Double backward is not supported.
"""
from __future__ import annotations

try:
    import torch  # noqa: F401
except ModuleNotFoundError as err:
    if err.name != "torch":
        raise
    raise ModuleNotFoundError("cunorm.torch needs PyTorch, which is not installed: pip install 'cunorm[torch]' "
                              "(or a torch build for your CUDA from pytorch.org)", name="torch") from err

from ._functions import (batch_norm, frobenius_normalize, group_norm, instance_norm, layer_norm, mean_abs_normalize,
                         normalize, rms_norm)
from ._layers import (BatchNorm1d, BatchNorm2d, BatchNorm3d, GroupNorm, InstanceNorm1d, InstanceNorm2d,
                      InstanceNorm3d, LayerNorm, RMSNorm)
from ._sync import SyncBatchNorm, convert_sync_batchnorm
from ._zoo import NormReport, replace_norms

__all__ = ["rms_norm", "layer_norm", "normalize", "mean_abs_normalize", "frobenius_normalize", "group_norm",
           "instance_norm", "batch_norm", "RMSNorm", "LayerNorm", "GroupNorm", "InstanceNorm1d", "InstanceNorm2d",
           "InstanceNorm3d", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "convert_sync_batchnorm",
           "replace_norms", "NormReport"]
