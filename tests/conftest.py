"""Suite-wide configuration: which tests CI runs again on the fallback route.

CI runs the whole suite on the full ``test`` install, then the tests marked
``kernels`` a second time with the compiled paths off (``TIEGRAD_NO_NUMBA=1``,
``TIEGRAD_BLAS=numpy``): the route a plain ``pip install .`` takes where numba or
oneMKL is missing. The mark follows from the module's name, so a new test file of
ops, optimizers or kernels joins the second pass without anyone remembering to.

Where oneMKL is installed but ``TIEGRAD_BLAS=auto`` leaves it unused (a CPU not Intel's,
``tiegrad.backend.blas``), CI runs the tests marked ``mkl`` a third time with
``TIEGRAD_BLAS=mkl``, so that MKL's route is tested on every machine that has it.
"""

from __future__ import annotations

import pytest

#: Modules that exercise the arithmetic: kernels, backends, ops, optimizers, and the
#: training steps whose bits resumption must repeat.
KERNEL_MODULES = (
    "test_blas",
    "test_checkpoint_models",
    "test_contracts_",
    "test_gradients_after_reset",
    "test_host_kernels",
    "test_models_",
    "test_nn_layers",
    "test_ops_",
    "test_optim_",
    "test_process_settings",
    "test_reference_cases",
    "test_step_bits",
    "test_tape",
)

#: Modules whose tests of oneMKL's route skip where MKL is not chosen.
MKL_MODULES = ("test_blas", "test_mkl_threads")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.startswith(KERNEL_MODULES):
            item.add_marker(pytest.mark.kernels)
        if item.module is not None and item.module.__name__.startswith(MKL_MODULES):
            item.add_marker(pytest.mark.mkl)
