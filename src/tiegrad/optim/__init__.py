"""Optimizers, gradient clipping and learning-rate schedules keyed by canonical slots.

torch.optim's names, arguments and defaults (``SGD``, ``Adam``, ``AdamW``, ``RMSprop``,
``Adagrad``) with tiegrad's guarantees: one summed gradient and one update per storage
(C4), state by canonical slot (C5), updates from the current value (C3) and complete
validation before the first write (C6). See ``Optimizer`` for the step protocol,
``clip`` for clipping and ``schedules`` for learning-rate schedules. With numba installed
(the extra ``tiegrad[fast]``) host steps run compiled single-pass kernels, bit for bit
equal to the NumPy rules (``fused``, ``kernels``).
"""

from . import schedules
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .clip import clip_grad_norm, clip_grad_value, total_norm
from .optimizer import Optimizer
from .rmsprop import RMSprop
from .sgd import SGD

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "Optimizer",
    "RMSprop",
    "clip_grad_norm",
    "clip_grad_value",
    "schedules",
    "total_norm",
]
