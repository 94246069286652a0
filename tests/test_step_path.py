"""One optimizer step goes down the layers: no module calls back into ``optim.optimizer``,
and nothing climbs the stack but the thread pool running the fused kernels' tasks."""

import pytest

from benchmarks.step_path import trace_step

POOL = ("tiegrad._threads", "tiegrad.optim.fused")  # a pool runs the task it was handed


@pytest.mark.parametrize("device", [False, True], ids=["host", "torch:cpu"])
def test_a_step_never_calls_back_up(device):
    if device:
        pytest.importorskip("torch")
    stops = trace_step(device)
    callees = {callee for _, callee, _ in stops}
    executor = "tiegrad.optim.device" if device else "tiegrad.optim.host"
    assert executor in callees and "tiegrad.optim.gradients" in callees
    into_optimizer = [caller for caller, callee, _ in stops if callee == "tiegrad.optim.optimizer"]
    assert into_optimizer == []
    climbs = {(caller, callee) for caller, callee, climbed in stops if climbed}
    assert climbs <= {POOL}
