"""tiegrad: eager autodiff and training with explicit, tieable parameter storage."""

from . import adapters, data, models, nn, ops, optim, train
from .checkpoint import LoadResult, inspect, load, save
from .errors import (
    AliasError,
    CheckpointError,
    ConfigError,
    DeviceError,
    DTypeError,
    HyperparameterError,
    IndexRangeError,
    MissingGradientError,
    NonFiniteError,
    ShapeError,
    SlotError,
    TapeError,
    TiegradError,
)
from .params import (
    Param,
    ParameterGroup,
    ParameterStorage,
    ParamList,
    dense_group_gradient,
    parameter_of_storage,
    with_device_group_gradient,
)
from .session import EagerSession, Gradients, TensorRef, latest_gradients

__version__ = "0.1.0"

__all__ = [
    "LoadResult",
    "inspect",
    "load",
    "save",
    "AliasError",
    "CheckpointError",
    "ConfigError",
    "DTypeError",
    "DeviceError",
    "EagerSession",
    "Gradients",
    "latest_gradients",
    "HyperparameterError",
    "IndexRangeError",
    "Param",
    "ParamList",
    "ParameterGroup",
    "ParameterStorage",
    "dense_group_gradient",
    "parameter_of_storage",
    "with_device_group_gradient",
    "MissingGradientError",
    "NonFiniteError",
    "ShapeError",
    "SlotError",
    "TapeError",
    "TensorRef",
    "TiegradError",
    "adapters",
    "data",
    "models",
    "nn",
    "ops",
    "optim",
    "train",
]
