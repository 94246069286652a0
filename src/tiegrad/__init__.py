"""tiegrad: eager autodiff and training with explicit, tieable parameter storage."""

from . import ops
from .errors import (
    AliasError,
    CheckpointError,
    ConfigError,
    DeviceError,
    DTypeError,
    HyperparameterError,
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
)
from .session import EagerSession, Gradients, TensorRef, latest_gradients

__version__ = "0.1.0"

__all__ = [
    "AliasError",
    "CheckpointError",
    "ConfigError",
    "DTypeError",
    "DeviceError",
    "EagerSession",
    "Gradients",
    "latest_gradients",
    "HyperparameterError",
    "Param",
    "ParamList",
    "ParameterGroup",
    "ParameterStorage",
    "dense_group_gradient",
    "parameter_of_storage",
    "MissingGradientError",
    "NonFiniteError",
    "ShapeError",
    "SlotError",
    "TapeError",
    "TensorRef",
    "TiegradError",
    "ops",
]
