"""Parameters as storage: cells, handles, packs, the alias map and session groups."""

from .canonical import canonical_indices
from .device import with_device_group_gradient
from .groups import ParameterGroup, dense_group_gradient, group_parameter_registrations
from .param import Param, parameter_of_storage
from .paramlist import ParamList
from .storage import ParameterStorage

__all__ = [
    "ParamList",
    "Param",
    "ParameterGroup",
    "ParameterStorage",
    "canonical_indices",
    "dense_group_gradient",
    "group_parameter_registrations",
    "parameter_of_storage",
    "with_device_group_gradient",
]
