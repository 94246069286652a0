"""Fast by default and the cold start (issue 17): numba is a default dependency where it
has wheels, and the ``tiegrad`` command compiles its kernels in child processes without
changing what a run computes."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import _tiegrad_launcher as launcher
from tiegrad import EagerSession, _numba
from tiegrad.train import precompile

ROOT = Path(__file__).resolve().parents[1]


def _dependencies():
    tomllib = pytest.importorskip("tomllib")
    requirements = pytest.importorskip("packaging.requirements")
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return project, {r.name: r for r in map(requirements.Requirement, project["dependencies"])}


def _environment(system, machine, python="3.11"):
    return {"sys_platform": system, "platform_machine": machine, "python_version": python}


def test_default_dependencies_carry_numba_where_it_has_wheels():
    project, deps = _dependencies()
    numba = deps["numba"]
    assert numba.marker is not None, "numba must be limited to the platforms with wheels"
    for system, machine in [
        ("linux", "x86_64"), ("linux", "aarch64"), ("darwin", "arm64"),
        ("darwin", "x86_64"), ("win32", "AMD64"), ("win32", "ARM64"),
    ]:  # fmt: skip
        assert numba.marker.evaluate(_environment(system, machine)), (system, machine)
    for system, machine in [("linux", "ppc64le"), ("linux", "armv7l"), ("freebsd14", "amd64")]:
        assert not numba.marker.evaluate(_environment(system, machine)), (system, machine)
    assert not numba.marker.evaluate(_environment("linux", "x86_64", "3.15"))
    assert "threadpoolctl" in deps
    assert "fast" in project["optional-dependencies"]  # old install commands keep working


def test_launcher_and_children_agree_on_the_kernel_modules():
    assert set(launcher.PRECOMPILED) == set(precompile.PARTS)


class _FakePopen:
    started: list = []

    def __init__(self, command, **kw):
        self.kw = kw
        self.command, self.env, self.group = command, kw["env"], kw.get("process_group")
        _FakePopen.started.append(self)


@pytest.mark.parametrize(
    "argv",
    [[], ["sample"], ["inspect", "x"], ["train", "--nproc", "2"], ["train", "--nproc=2"],
     ["train", "--help"], ["resume", "-h"]],
)  # fmt: skip
def test_launcher_starts_no_child_but_for_a_training_command(argv, monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", _FakePopen)
    _FakePopen.started = []
    assert launcher.start_precompile(argv) == {}
    assert _FakePopen.started == []


def test_launcher_starts_one_single_threaded_child_per_part(monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", _FakePopen)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(launcher.os, "getloadavg", lambda: (0.5, 0.5, 0.5), raising=False)
    children = launcher.start_precompile(["train", "--steps", "3"])
    assert set(children) == set(launcher.PRECOMPILED)
    for part, child in children.items():
        assert child.command == [sys.executable, "-m", "tiegrad.train.precompile", part]
        assert all(child.env[name] == "1" for name in launcher.CHILD_THREADS)
        assert "start_new_session" not in child.kw  # niceness counts within the session
        if sys.version_info >= (3, 11):
            assert child.group == 0  # the terminal's Ctrl-C reaches the run, not the children


def test_launcher_starts_no_child_without_an_idle_cpu(monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", _FakePopen)
    monkeypatch.setattr(launcher.os, "getloadavg", lambda: (1.5, 0.5, 0.5), raising=False)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert launcher.start_precompile(["train"]) == {}  # busy: the command compiles itself
    monkeypatch.setattr(launcher.os, "getloadavg", lambda: (0.0, 0.0, 0.0), raising=False)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert launcher.start_precompile(["train"]) == {}  # one CPU


@pytest.fixture
def loads(monkeypatch):
    """``tiegrad._numba`` on, nothing deferred, ``_load`` recording the modules it loads."""
    loaded = []
    monkeypatch.setattr(_numba, "_load", lambda module: loaded.append(module) or module)
    monkeypatch.setattr(_numba, "ENABLED", True)
    monkeypatch.setattr(_numba, "_deferred", {})
    return loaded


def test_a_deferred_module_gives_its_stand_in_until_ready(loads):
    ready, own = threading.Event(), threading.Event()
    _numba.defer("pkg.a", ready)
    _numba.defer("pkg.c", own, "string")  # any importable module as the stand-in
    assert _numba.kernels("pkg.b") == "pkg.b"  # another module is not deferred
    assert _numba.kernels("pkg.a") is None  # the callers' NumPy code runs
    assert _numba.kernels("pkg.c") is sys.modules["string"]
    ready.set()
    own.set()
    assert _numba.kernels("pkg.a") == "pkg.a"
    assert _numba.kernels("pkg.a") == "pkg.a"
    assert _numba.kernels("pkg.c") == "pkg.c"
    assert loads == ["pkg.b", "pkg.a", "pkg.a", "pkg.c"]
    assert _numba._deferred == {}


def test_the_switch_off_wins_over_a_deferred_module(monkeypatch):
    monkeypatch.setattr(_numba, "ENABLED", False)
    ready = threading.Event()
    ready.set()
    monkeypatch.setattr(_numba, "_deferred", {"pkg.a": (ready, "string")})
    assert _numba.kernels("pkg.a") is None


def _child(code):
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.fixture
def kernels(monkeypatch, loads, tmp_path):
    """Part ``a`` of module ``pkg.a`` (stand-in ``string``, module ``pkg.calls_a``
    calling its kernels) and part ``b`` of ``pkg.b`` (the callers' NumPy code), each
    marked done at ``tmp_path / part``; ``_load`` gives one module object for all, and
    numba's set-up is left out."""
    module = type("Kernels", (), {})
    monkeypatch.setattr(_numba, "_load", lambda name: loads.append(name) or module)
    monkeypatch.setattr(_numba, "warm_up", lambda: None)
    parts = {
        "a": precompile.Part("pkg.a", lambda: None, "string", ("pkg.calls_a",)),
        "b": precompile.Part("pkg.b", lambda: None),
    }
    monkeypatch.setattr(precompile, "PARTS", parts)
    monkeypatch.setattr(precompile, "_done_path", lambda kernels, part: str(tmp_path / part))
    return module


def test_each_module_is_used_once_its_child_has_ended(kernels):
    a = _child("import time; time.sleep(60)")
    b = _child("import time; time.sleep(60)")
    compiling = precompile.Precompiling({"a": a, "b": b})
    assert set(_numba._deferred) == {"pkg.a", "pkg.calls_a", "pkg.b"}
    assert _numba.kernels("pkg.a") is sys.modules["string"]  # the stand-in meanwhile
    assert _numba.kernels("pkg.calls_a") is None
    assert _numba.kernels("pkg.b") is None  # the NumPy code meanwhile
    compiling.stop()  # the command ends early: the children are killed
    assert a.returncode is not None and b.returncode is not None
    assert _numba.kernels("pkg.a") is _numba.kernels("pkg.b") is kernels
    assert _numba.kernels("pkg.calls_a") is kernels


def test_a_module_waits_for_its_own_children_alone(kernels):
    # a's child still compiles when b's ends: b is used at once, a keeps its stand-in.
    a = _child("import time; time.sleep(60)")
    b = _child("import time; time.sleep(0.5)")
    compiling = precompile.Precompiling({"a": a, "b": b})
    b.wait(60)
    for _ in range(600):
        if _numba.kernels("pkg.b") is kernels:
            break
        threading.Event().wait(0.1)
    assert _numba.kernels("pkg.b") is kernels
    assert _numba.kernels("pkg.a") is sys.modules["string"] and a.poll() is None
    assert _numba.kernels("pkg.calls_a") is None
    compiling.stop()


def test_without_numba_the_children_are_stopped(kernels, monkeypatch):
    # numba installed but failing to import: the children have nothing to compile and
    # the stand-in, which takes the kernels' constants, is not used.
    monkeypatch.setattr(_numba, "_load", lambda name: None)
    a, b = _child("import time; time.sleep(60)"), _child("import time; time.sleep(60)")
    compiling = precompile.Precompiling({"a": a, "b": b})
    assert a.returncode is not None and b.returncode is not None
    assert _numba._deferred == {}
    compiling.stop()


def test_a_part_marked_done_by_an_earlier_run_stops_its_child(tmp_path, kernels):
    (tmp_path / "b").touch()
    b = _child("import time; time.sleep(60)")
    compiling = precompile.Precompiling({"b": b})
    assert b.returncode is not None  # stopped at once: nothing was left for it to compile
    assert _numba.kernels("pkg.b") is kernels  # nothing deferred
    compiling.finish()
    compiling.stop()


def test_without_a_cache_the_children_are_stopped(kernels, monkeypatch):
    # A child passes its kernels on through numba's cache alone.
    monkeypatch.setattr(precompile, "_done_path", lambda kernels, part: None)
    a, b = _child("import time; time.sleep(60)"), _child("import time; time.sleep(60)")
    compiling = precompile.Precompiling({"a": a, "b": b})
    assert a.returncode is not None and b.returncode is not None
    assert _numba._deferred == {}
    compiling.stop()


def test_a_failed_or_stuck_child_only_costs_time(kernels, monkeypatch):
    failed = _child("raise SystemExit(3)")
    monkeypatch.setattr(precompile, "WAIT_S", 0.5)
    stuck = _child("import time; time.sleep(60)")
    compiling = precompile.Precompiling({"a": failed, "b": stuck})
    compiling.watcher.join(60)
    assert failed.poll() == 3
    assert stuck.returncode is not None  # killed after WAIT_S
    assert _numba.kernels("pkg.a") is _numba.kernels("pkg.b") is kernels  # compiled on use
    compiling.stop()


def test_stop_kills_the_children_and_ends_the_watcher(kernels):
    running = _child("import time; time.sleep(60)")
    compiling = precompile.Precompiling({"b": running})
    compiling.stop()
    assert running.returncode is not None
    assert not compiling.watcher.is_alive()


def test_finish_waits_for_the_children(tmp_path, kernels):
    child = _child(f"import time; time.sleep(0.5); open({str(tmp_path / 'b')!r}, 'w')")
    compiling = precompile.Precompiling({"b": child})
    assert _numba.kernels("pkg.b") is None  # the NumPy code meanwhile
    compiling.finish()
    assert child.returncode == 0
    compiling.stop()
    assert (tmp_path / "b").exists()  # marked for the next run


def test_without_compiled_kernels_the_children_are_stopped(monkeypatch):
    monkeypatch.setattr(_numba, "ENABLED", False)
    monkeypatch.setattr(_numba, "_deferred", {})
    running = _child("import time; time.sleep(60)")
    compiling = precompile.Precompiling({"optimizer": running})
    assert running.returncode is not None
    assert compiling.watcher is None and _numba._deferred == {}


@pytest.mark.skipif(_numba.kernels("tiegrad.optim.kernels") is None, reason="needs numba")
def test_every_kernel_module_waits_for_its_child_on_numpy_code_with_its_bits(monkeypatch, tmp_path):
    # The host kernels' stand-in gives their bits (test_host_reference), the optimizer's
    # own NumPy code gives its kernels' (test_optim_fused); host_blocks' drivers call
    # the host kernels, so they wait too. An empty cache: no part is marked done.
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_numba, "ENABLED", True)
    monkeypatch.setattr(_numba, "_deferred", {})
    monkeypatch.setattr(precompile, "_done_path", lambda kernels, part: str(tmp_path / part))
    compiling = precompile.Precompiling({part: _child("pass") for part in precompile.PARTS})
    deferred = dict(_numba._deferred)
    compiling.stop()
    assert {module: stand_in for module, (_, stand_in) in deferred.items()} == {
        "tiegrad.backend.host_kernels": "tiegrad.backend.host_reference",
        "tiegrad.backend.host_blocks": None,
        "tiegrad.optim.kernels": None,
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_import_starts_no_thread_and_no_process():
    # NumPy's BLAS may start its own threads when NumPy loads: counted before tiegrad.
    code = (
        "import os, threading, numpy\n"
        "before = sorted(os.listdir('/proc/self/task'))\n"
        "import tiegrad, tiegrad.cli, tiegrad._numba as n\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "assert sorted(os.listdir('/proc/self/task')) == before, 'native threads started'\n"
        "children = open(f'/proc/self/task/{os.getpid()}/children').read().split()\n"
        "assert children == [], children\n"
        "assert n._deferred == {}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# The default model (the children compile for its sizes), few steps on a short corpus.
SHORT = ["--corpus-chars", "20000", "--steps", "2", "--eval-batches", "1", "--no-progress"]


# The console script with its compile children, however busy the machine is.
WITH_CHILDREN = [
    "-c",
    "import sys, _tiegrad_launcher as m; m.idle_cpus = lambda: 2.0; sys.exit(m.main())",
]
WITHOUT_CHILDREN = ["-m", "tiegrad"]


def _train(command, folder, cache, run):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), NUMBA_DEBUG_CACHE="1")
    env.pop(_numba.ENV_SWITCH, None)
    proc = subprocess.run(
        [sys.executable, *command, "train", "--run", run, *SHORT],
        cwd=folder, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = (folder / run / "metrics.jsonl").read_text().splitlines()
    return proc.stdout + proc.stderr, [r for r in map(json.loads, lines) if "train_loss" in r]


@pytest.mark.slow
@pytest.mark.skipif(_numba.kernels("tiegrad.optim.kernels") is None, reason="needs numba")
def test_children_compile_every_kernel_and_the_run_computes_the_same(tmp_path):
    # The command with an empty cache: the run compiles no kernel itself (numba's cache
    # log of the run's own process; it steps on NumPy code with the kernels' bits until
    # the children have compiled them), and it waits for the children at its end, so
    # that the next run loads every kernel from the cache. The same bits either way.
    out, cold = _train(WITH_CHILDREN, tmp_path, tmp_path / "cache", "cold")
    assert "data saved" not in out, out
    assert len(list((tmp_path / "cache").rglob("tiegrad-*.done"))) == len(precompile.PARTS)
    # From the filled cache with children (stopped: their parts are marked done) and
    # without them (the package's entry point): nothing compiles, the same bits.
    runs = [cold]
    for command, name in ((WITH_CHILDREN, "warm"), (WITHOUT_CHILDREN, "cached")):
        out, run = _train(command, tmp_path, tmp_path / "cache", name)
        assert "data saved" not in out, out
        runs.append(run)
    losses = [[(r["train_loss"], r["grad_norm"]) for r in run] for run in runs]
    assert losses[0] == losses[1] == losses[2]


def _training():
    """The default model in training mode, its optimizer at a learning rate of 0.01 and
    one batch."""
    model, optimizer, batch = precompile._default_run()
    for group in optimizer.param_groups:
        group["lr"] = 0.01
    model.train()
    return model, optimizer, batch


def _three_steps(switch, ready):
    """Three training steps of the default model on one batch at a learning rate of
    0.01; ``ready`` set before step ``switch``'s update (None: never). The losses and
    the parameters' bytes."""
    model, optimizer, batch = _training()
    losses = []
    for step in range(3):
        grads = precompile._gradients(model, optimizer, batch)
        if step == switch:
            ready.set()
        optimizer.step(grads)
        losses.append(float(model.loss(EagerSession(), *batch).value))
    return losses, [p.value.tobytes() for p in optimizer.params]


@pytest.fixture(scope="module")
def numpy_updates():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_numba, "_deferred", {})
        _numba.defer("tiegrad.optim.kernels", threading.Event())
        return _three_steps(None, threading.Event())


@pytest.mark.skipif(_numba.kernels("tiegrad.optim.kernels") is None, reason="needs numba")
@pytest.mark.parametrize("switch", [0, 1, 2])
def test_a_switch_to_the_optimizer_kernels_within_a_run_changes_no_bit(
    switch, numpy_updates, monkeypatch
):
    # The host kernels from the first step, the optimizer's deferred until ``switch``:
    # the same bits as a run whose updates all ran on the NumPy code.
    monkeypatch.setattr(_numba, "ENABLED", True)
    monkeypatch.setattr(_numba, "_deferred", {})
    ready = threading.Event()
    _numba.defer("tiegrad.optim.kernels", ready)
    assert _three_steps(switch, ready) == numpy_updates
    assert _numba._deferred == {}
    losses, _ = numpy_updates
    assert len(set(losses)) == 3  # the updates changed the model


def _host_switch_steps(switch):
    """Three training steps of the default model on one batch at a learning rate of
    0.01, the host kernels deferred to their stand-in until the forward of step
    ``switch`` has run (its backward then runs on the kernels; None: never; -1: not
    deferred at all). The losses and the parameters' bytes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_numba, "ENABLED", True)
        mp.setattr(_numba, "_deferred", {})
        ready = threading.Event()
        if switch != -1:
            _numba.defer(precompile.HOST_KERNELS, ready, "tiegrad.backend.host_reference")
        model, optimizer, batch = _training()
        losses = []
        for step in range(3):
            s = EagerSession()
            loss = model.loss(s, *batch)
            if step == switch:
                ready.set()
            grads = optimizer.canonical_gradients(s.backward(loss))
            s.reset()
            optimizer.step(grads)
            losses.append(float(loss.value))
        return losses, [p.value.tobytes() for p in optimizer.params]


@pytest.mark.skipif(_numba.kernels(precompile.HOST_KERNELS) is None, reason="needs numba")
def test_a_switch_to_the_host_kernels_within_a_run_changes_no_bit():
    # Forward and backward on the stand-in (None), the switch between a forward and
    # its backward (0, 2), the kernels throughout (-1): the same bits.
    runs = [_host_switch_steps(switch) for switch in (-1, None, 0, 2)]
    assert runs[1] == runs[0] and runs[2] == runs[0] and runs[3] == runs[0]
    assert len(set(runs[0][0])) == 3  # the updates changed the model
