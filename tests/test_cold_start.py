"""Fast by default and the cold start (issue 17): numba is a default dependency where it
has wheels, and the ``tiegrad`` command compiles its kernels in a child process without
changing what a run computes."""

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import _tiegrad_launcher as launcher
from tiegrad import EagerSession, _numba
from tiegrad.data import TextDataset
from tiegrad.optim.clip import clip_grad_norm
from tiegrad.train import Trainer, precompile, read_metrics
from tiegrad.train.callbacks import Callback
from tiegrad.train.config import DEFAULTS
from tiegrad.train.job import build_model, build_optimizer, model_config

ROOT = Path(__file__).resolve().parents[1]
TEXT = "".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 5}\n" for i in range(120))


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


def test_the_child_runs_the_parts_in_their_order(monkeypatch):
    # The run lets a module in after the last of its parts in PARTS' order.
    # The child lowers its priority after the host kernels' parts, before the update.
    monkeypatch.setattr(_numba, "ENABLED", False)  # NumPy code: nothing to compile here
    events = []
    monkeypatch.setattr(os, "nice", lambda n: events.append(("nice", n)), raising=False)
    parts = [part for part in precompile._parts() if not events.append(part)]
    assert parts == list(precompile.PARTS)
    assert events == [*list(precompile.PARTS)[:-1], ("nice", precompile.NICENESS), "optimizer"]
    assert set(precompile.PARTS.values()) == set(precompile.MODULES)


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
    assert launcher.start_precompile(argv) is None
    assert _FakePopen.started == []


def test_launcher_starts_one_single_threaded_child(monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", _FakePopen)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(launcher.os, "getloadavg", lambda: (0.5, 0.5, 0.5), raising=False)
    child = launcher.start_precompile(["train", "--steps", "3"])
    assert child.command == [sys.executable, "-m", "tiegrad.train.precompile"]
    assert child.kw["stdout"] == subprocess.PIPE and child.kw["text"]  # its reports
    assert all(child.env[name] == "1" for name in launcher.CHILD_THREADS)
    assert "start_new_session" not in child.kw  # niceness counts within the session
    if sys.version_info >= (3, 11):
        assert child.group == 0  # the terminal's Ctrl-C reaches the run, not the child


def test_launcher_starts_no_child_without_an_idle_cpu(monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", _FakePopen)
    monkeypatch.setattr(launcher.os, "getloadavg", lambda: (1.5, 0.5, 0.5), raising=False)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert launcher.start_precompile(["train"]) is None  # busy: the command compiles itself
    monkeypatch.setattr(launcher.os, "getloadavg", lambda: (0.0, 0.0, 0.0), raising=False)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert launcher.start_precompile(["train"]) is None  # one CPU


class _Kernels:
    """A compiled kernel module: ``capwords`` and ``Template`` of its own."""

    capwords, Template = object(), object()


class _Interrupt:
    """A finder interrupting the import of ``tiegrad.cli`` (Ctrl-C while it imports)."""

    def find_spec(self, name, path=None, target=None):
        if name == "tiegrad.cli":
            raise KeyboardInterrupt
        return None


def test_the_child_is_stopped_where_the_commands_import_is_interrupted(monkeypatch):
    child = _reports()
    monkeypatch.setattr(launcher, "start_precompile", lambda argv: child)
    monkeypatch.delitem(sys.modules, "tiegrad.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Interrupt(), *sys.meta_path])
    assert launcher.main() == launcher.EXIT_INTERRUPTED
    assert child.returncode is not None and child.stdout.closed  # no file left open


@pytest.fixture
def loads(monkeypatch):
    """``tiegrad._numba`` on, nothing deferred, ``_load`` recording the modules it loads
    and giving ``_Kernels`` for every one."""
    loaded = []
    monkeypatch.setattr(_numba, "_load", lambda module: loaded.append(module) or _Kernels)
    monkeypatch.setattr(_numba, "ENABLED", True)
    monkeypatch.setattr(_numba, "_deferred", {})
    return loaded


def test_a_deferred_module_gives_its_stand_in_until_ready(loads):
    _numba.defer("pkg.a")
    _numba.defer("pkg.c", "string")  # any importable module as the stand-in
    assert _numba.kernels("pkg.b") is _Kernels  # another module is not deferred
    assert _numba.kernels("pkg.a") is None  # the callers' NumPy code runs
    assert _numba.kernels("pkg.c") is sys.modules["string"]
    _numba.ready("pkg.a", ["capwords"])  # nothing to mix into the callers' own code
    assert _numba.kernels("pkg.a") is None
    _numba.ready("pkg.a")
    _numba.ready("pkg.c")
    assert _numba.kernels("pkg.a") is _numba.kernels("pkg.c") is _Kernels
    assert loads == ["pkg.b", "pkg.a", "pkg.c"]
    assert _numba._deferred == {}
    _numba.ready("pkg.d")  # not deferred: nothing


def test_the_kernels_let_in_by_name_replace_the_stand_ins_functions_alone(loads):
    import string

    _numba.defer("pkg.c", "string")
    _numba.ready("pkg.c", ["capwords", "nothing"])  # a name neither has: left out
    mixed = _numba.kernels("pkg.c")
    assert not hasattr(mixed, "nothing")
    assert mixed.capwords is _Kernels.capwords
    assert mixed.Template is string.Template and mixed.ascii_letters == string.ascii_letters
    assert string.capwords is not _Kernels.capwords  # the stand-in itself is unchanged
    _numba.ready("pkg.c", ["Template"])
    mixed = _numba.kernels("pkg.c")
    assert mixed.capwords is _Kernels.capwords and mixed.Template is _Kernels.Template
    _numba.ready("pkg.c")
    assert _numba.kernels("pkg.c") is _Kernels


def test_the_set_up_of_a_numba_that_does_not_import_does_nothing(monkeypatch):
    # The watching thread sets numba up first; kernels() warns of a broken numba.
    monkeypatch.setitem(sys.modules, "numba", None)  # ``import numba`` raises ImportError
    monkeypatch.setattr(_numba.importlib.util, "find_spec", lambda name: object())
    assert _numba.warm_up.__wrapped__() is None


def test_the_switch_off_wins_over_a_deferred_module(monkeypatch):
    monkeypatch.setattr(_numba, "ENABLED", False)
    monkeypatch.setattr(_numba, "_deferred", {"pkg.a": sys.modules["string"]})
    assert _numba.kernels("pkg.a") is None


def _child(code):
    """A child process running ``code``, its standard output read by the run."""
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _reports(*lines, then="import time; time.sleep(60)"):
    """A child printing ``lines`` as the compile child reports its parts, then ``then``."""
    return _child(f"print({chr(10).join(lines)!r}, flush=True)\n{then}")


@pytest.fixture
def kernels(monkeypatch, loads, tmp_path):
    """Parts ``a1`` and ``a2`` of module ``pkg.a`` (stand-in ``string``, module
    ``pkg.calls_a`` calling its kernels) and part ``b`` of ``pkg.b`` (the callers' NumPy
    code), each marked done at ``tmp_path / part``; ``_load`` gives ``_Kernels`` for
    every module, and numba's set-up is left out."""
    monkeypatch.setattr(_numba, "warm_up", lambda: None)
    monkeypatch.setattr(
        precompile,
        "MODULES",
        {"pkg.a": precompile.Kernels("string", ("pkg.calls_a",)), "pkg.b": precompile.Kernels()},
    )
    monkeypatch.setattr(precompile, "PARTS", {"a1": "pkg.a", "a2": "pkg.a", "b": "pkg.b"})
    monkeypatch.setattr(precompile, "_done_path", lambda kernels, part: str(tmp_path / part))
    return _Kernels


@pytest.fixture
def watch(monkeypatch):
    """``Precompiling`` of a child; each one stopped at the end of the test, before the
    patches of ``_numba`` are undone, whatever the test asserted."""
    started = []
    yield lambda child: started.append(precompile.Precompiling(child)) or started[-1]
    for compiling in started:
        compiling.stop()


def _until(condition):
    """Wait up to a minute for ``condition()``; its last value."""
    for _ in range(600):
        if condition():
            return True
        threading.Event().wait(0.1)
    return condition()


def test_the_kernels_of_each_part_are_let_in_once_the_child_reports_it(kernels, watch):
    import string

    child = _reports("a1 nothing capwords", "\xff\n")  # names the module lacks: left out
    compiling = watch(child)
    assert set(_numba._deferred) == {"pkg.a", "pkg.calls_a", "pkg.b"}
    assert _until(lambda: _numba.kernels("pkg.a").capwords is kernels.capwords)
    assert _numba.kernels("pkg.a").Template is string.Template  # a2's: the stand-in's
    assert _numba.kernels("pkg.calls_a") is None and _numba.kernels("pkg.b") is None
    compiling.stop()  # the command ends early: the child is killed, every module let in
    assert child.returncode is not None and not compiling.watcher.is_alive()
    assert _numba.kernels("pkg.a") is _numba.kernels("pkg.b") is kernels
    assert _numba.kernels("pkg.calls_a") is kernels


def test_a_module_is_let_in_whole_after_its_last_part(kernels, watch):
    # a's parts are done while b's is not: a and its callers are used, b keeps waiting.
    child = _reports("not a part", "a1 capwords", "a2 capwords Template")
    watch(child)
    assert _until(lambda: _numba.kernels("pkg.a") is kernels)
    assert _numba.kernels("pkg.calls_a") is kernels
    assert _numba.kernels("pkg.b") is None and child.poll() is None


def test_without_numba_the_child_is_stopped(kernels, monkeypatch, watch):
    # numba installed but failing to import: the child has nothing to compile and the
    # stand-in, which takes the kernels' constants, is not used.
    monkeypatch.setattr(_numba, "_load", lambda name: None)
    child = _reports()
    watch(child)
    assert child.returncode is not None and _numba._deferred == {}


def test_a_module_whose_parts_an_earlier_run_marked_done_is_not_deferred(tmp_path, kernels, watch):
    (tmp_path / "b").touch()
    (tmp_path / "a1").touch()
    child = _reports()
    compiling = watch(child)
    assert set(_numba._deferred) == {"pkg.a", "pkg.calls_a"}  # a2 is not marked
    assert _numba.kernels("pkg.b") is kernels and child.poll() is None
    compiling.stop()
    (tmp_path / "a2").touch()
    child = _reports()
    compiling = watch(child)
    assert child.returncode is not None  # stopped at once: nothing left to compile
    assert _numba._deferred == {}
    compiling.finish()


def test_without_a_cache_the_child_is_stopped(kernels, monkeypatch, watch):
    # The child passes its kernels on through numba's cache alone.
    monkeypatch.setattr(precompile, "_done_path", lambda kernels, part: None)
    child = _reports()
    watch(child)
    assert child.returncode is not None and _numba._deferred == {}


@pytest.mark.parametrize("code", ["raise SystemExit(3)", "import time; time.sleep(60)"])
def test_a_failed_or_stuck_child_only_costs_time(code, kernels, monkeypatch, watch):
    monkeypatch.setattr(precompile, "WAIT_S", 0.5)
    child = _reports("a1 capwords", then=code)
    compiling = watch(child)
    compiling.watcher.join(60)
    assert child.returncode is not None  # ended, or killed after WAIT_S
    assert _numba.kernels("pkg.a") is _numba.kernels("pkg.b") is kernels  # compiled on use


def test_finish_waits_for_the_child(tmp_path, kernels, watch):
    child = _reports(then=f"import time; time.sleep(0.5); open({str(tmp_path / 'b')!r}, 'w')")
    compiling = watch(child)
    assert _numba.kernels("pkg.b") is None  # the NumPy code meanwhile
    compiling.finish()
    assert child.returncode == 0
    compiling.stop()
    assert (tmp_path / "b").exists()  # marked for the next run


def test_without_compiled_kernels_the_child_is_stopped(monkeypatch, watch):
    monkeypatch.setattr(_numba, "ENABLED", False)
    monkeypatch.setattr(_numba, "_deferred", {})
    child = _reports()
    compiling = watch(child)
    assert child.returncode is not None
    assert compiling.watcher is None and _numba._deferred == {}


def test_without_a_child_nothing_is_deferred(kernels, watch):
    compiling = watch(None)  # python -m tiegrad, or a busy machine
    assert compiling.watcher is None and _numba._deferred == {}
    compiling.finish()


@pytest.mark.skipif(_numba.kernels("tiegrad.optim.kernels") is None, reason="needs numba")
def test_every_kernel_module_waits_for_the_child_on_numpy_code_with_its_bits(
    monkeypatch, tmp_path, watch
):
    # The host kernels' stand-in gives their bits (test_host_reference), the optimizer's
    # own NumPy code gives its kernels' (test_optim_fused); host_blocks' drivers call
    # the host kernels, so they wait too. An empty cache: no part is marked done.
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_numba, "ENABLED", True)
    monkeypatch.setattr(_numba, "_deferred", {})
    monkeypatch.setattr(precompile, "_done_path", lambda kernels, part: str(tmp_path / part))
    compiling = watch(_reports())
    deferred = dict(_numba._deferred)
    compiling.stop()
    assert {module: getattr(v, "__name__", None) for module, v in deferred.items()} == {
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


# The default model (the child compiles for its sizes), few steps on a short corpus.
SHORT = ["--corpus-chars", "20000", "--steps", "2", "--eval-batches", "1", "--no-progress"]


# The console script with its compile child, however busy the machine is.
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
def test_the_child_reports_each_part_with_the_kernels_compiled_so_far(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    env.pop(_numba.ENV_SWITCH, None)
    proc = subprocess.run(
        [sys.executable, "-m", "tiegrad.train.precompile"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert [line[0] for line in lines] == list(precompile.PARTS)
    reported = {part: names for part, *names in lines}
    assert reported["gelu"] == ["gelu"] and reported["softmax"] == ["gelu", "softmax"]
    assert reported["forward"] == FORWARD
    assert set(FORWARD) < set(reported["backward"])  # the same module: and the backward's
    assert {"adam", "nonfinite"} <= set(reported["optimizer"])
    assert len(list(tmp_path.rglob("tiegrad-*.done"))) == len(precompile.PARTS)


@pytest.mark.slow
@pytest.mark.skipif(_numba.kernels("tiegrad.optim.kernels") is None, reason="needs numba")
def test_the_child_compiles_every_kernel_and_the_run_computes_the_same(tmp_path):
    # The command with an empty cache: the run compiles no kernel itself (numba's cache
    # log of the run's own process; it steps on NumPy code with the kernels' bits until
    # the child has compiled them), and it waits for the child at its end, so that the
    # next run loads every kernel from the cache. The same bits either way.
    out, cold = _train(WITH_CHILDREN, tmp_path, tmp_path / "cache", "cold")
    assert "data saved" not in out, out
    assert len(list((tmp_path / "cache").rglob("tiegrad-*.done"))) == len(precompile.PARTS)
    # From the filled cache with a child (stopped: its parts are marked done) and
    # without one (the package's entry point): nothing compiles, the same bits.
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


def _three_steps(switch):
    """Three training steps of the default model on one batch at a learning rate of
    0.01, the optimizer's kernels let in before step ``switch``'s update (None: never).
    The losses and the parameters' bytes."""
    model, optimizer, batch = _training()
    losses = []
    for step in range(3):
        s = EagerSession()
        grads = optimizer.canonical_gradients(s.backward(model.loss(s, *batch)))
        s.reset()
        clip_grad_norm(grads, 1.0)
        if step == switch:
            _numba.ready("tiegrad.optim.kernels")
        optimizer.step(grads)
        losses.append(float(model.loss(EagerSession(), *batch).value))
    return losses, [p.value.tobytes() for p in optimizer.params]


@pytest.fixture(scope="module")
def numpy_updates():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_numba, "_deferred", {})
        _numba.defer("tiegrad.optim.kernels")
        return _three_steps(None)


@pytest.mark.skipif(_numba.kernels("tiegrad.optim.kernels") is None, reason="needs numba")
@pytest.mark.parametrize("switch", [0, 1, 2])
def test_a_switch_to_the_optimizer_kernels_within_a_run_changes_no_bit(
    switch, numpy_updates, monkeypatch
):
    # The host kernels from the first step, the optimizer's deferred until ``switch``:
    # the same bits as a run whose updates all ran on the NumPy code.
    monkeypatch.setattr(_numba, "ENABLED", True)
    monkeypatch.setattr(_numba, "_deferred", {})
    _numba.defer("tiegrad.optim.kernels")
    assert _three_steps(switch) == numpy_updates
    assert _numba._deferred == {}
    losses, _ = numpy_updates
    assert len(set(losses)) == 3  # the updates changed the model


FORWARD = [
    "add_row_vector",
    "cross_entropy",
    "cross_entropy_backward",  # the fused head's loss makes its gradients in the forward
    "gelu",
    "layer_norm",
    "softmax",
]  # reported after the forward


def _host_switch_steps(switch, names=None):
    """Three training steps of the default model on one batch at a learning rate of
    0.01, the host kernels deferred to their stand-in until the forward of step
    ``switch`` has run, then let in: those called ``names``, or the module (None).
    ``switch`` None: never; -1: not deferred at all. The losses and the parameters'
    bytes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_numba, "ENABLED", True)
        mp.setattr(_numba, "_deferred", {})
        if switch != -1:  # as the command defers them (precompile.MODULES)
            _numba.defer(precompile.HOST_KERNELS, "tiegrad.backend.host_reference")
            _numba.defer(precompile.HOST_BLOCKS)
        model, optimizer, batch = _training()
        losses = []
        for step in range(3):
            s = EagerSession()
            loss = model.loss(s, *batch)
            if step == switch:
                _numba.ready(precompile.HOST_KERNELS, names)
                if names is None:
                    _numba.ready(precompile.HOST_BLOCKS)
            grads = optimizer.canonical_gradients(s.backward(loss))
            s.reset()
            optimizer.step(grads)
            losses.append(float(loss.value))
        return losses, [p.value.tobytes() for p in optimizer.params]


@pytest.mark.skipif(_numba.kernels(precompile.HOST_KERNELS) is None, reason="needs numba")
def test_a_switch_to_the_host_kernels_within_a_run_changes_no_bit():
    # Forward and backward on the stand-in (None), the switch between a forward and its
    # backward (0, 2), of the whole module or of the kernels the child reports first
    # (the others then stay on the stand-in), the kernels throughout (-1): the same bits.
    kernels = _host_switch_steps(-1)
    assert len(set(kernels[0])) == 3  # the updates changed the model
    switches = [(None, None), (0, None), (2, None), (0, ["gelu"]), (1, ["gelu", "softmax"])]
    for switch, names in [*switches, (0, FORWARD), (1, FORWARD)]:
        assert _host_switch_steps(switch, names) == kernels, (switch, names)


class _LetIn(Callback):
    """Lets in the kernels the command defers, after step ``step``'s update: the
    host kernels called ``names`` (None: every kernel module, whole)."""

    def __init__(self, step, names=None):
        self.step, self.names = step, names

    def on_step_end(self, trainer, logs):
        if trainer.step != self.step:
            return
        if self.names is not None:
            _numba.ready(precompile.HOST_KERNELS, self.names)
            return
        for module, kernels in precompile.MODULES.items():
            _numba.ready(module)
            for caller in kernels.callers:
                _numba.ready(caller)


# A tiny default-shaped run: the command's model, optimizer, schedule, clip and data.
TINY_RUN = {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 12, "steps": 24}


def _first_run(folder, let_in):
    """``Trainer.fit`` of ``TINY_RUN`` on random windows of a short text, evaluated every
    8 steps, every kernel module deferred as the command defers it with an empty cache
    (``let_in``: the ``_LetIn`` callback that lets them in; None: never), or none
    deferred (``let_in`` -1, a warm run). Its metrics and the parameters' bytes."""
    config = {**DEFAULTS, **TINY_RUN}
    data = TextDataset(TEXT * 4, block_size=config["seq_len"], vocab="char", val_fraction=0.2)
    model = build_model(model_config(config, data.vocab_size))
    optimizer, schedule = build_optimizer(config, model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_numba, "ENABLED", True)
        mp.setattr(_numba, "_deferred", {})
        if let_in != -1:
            for module, kernels in precompile.MODULES.items():
                _numba.defer(module, kernels.stand_in)
                for caller in kernels.callers:
                    _numba.defer(caller)
        trainer = Trainer(
            model, optimizer, None, data.loader("train", 4), data.eval_batches("val", 4, 2),
            schedule, max_steps=config["steps"], clip_norm=config["clip_norm"], eval_every=8,
            run_dir=folder, progress=False, plot=False, out=io.StringIO(),
            callbacks=[] if let_in in (None, -1) else [let_in],
        )  # fmt: skip
        trainer.fit()
    metrics = [{k: r[k] for k in r if k not in ("elapsed", "throughput")} for r in
               read_metrics(folder / "metrics.jsonl")]  # fmt: skip
    return metrics, [p.value.tobytes() for p in optimizer.params]


@pytest.mark.skipif(_numba.kernels(precompile.HOST_KERNELS) is None, reason="needs numba")
def test_a_first_run_on_an_empty_cache_prints_what_a_warm_run_prints(tmp_path):
    # A first run steps on the stand-ins until the child has compiled the kernels, which
    # it then lets in (each part's, or every module at once) at whatever step: losses,
    # gradient norms, evaluations and weights are a warm run's, bit for bit.
    warm = _first_run(tmp_path / "warm", -1)
    assert len({r["train_loss"] for r in warm[0] if "train_loss" in r}) > 1
    assert sum("val_loss" in r for r in warm[0]) == 3
    cases = {
        "never": None,
        "whole at 5": _LetIn(5),
        "whole at 13": _LetIn(13),
        "gelu and softmax at 3": _LetIn(3, ["gelu", "softmax"]),
        "the forward at 9": _LetIn(9, FORWARD),
    }
    for name, let_in in cases.items():
        assert _first_run(tmp_path / name, let_in) == warm, name
