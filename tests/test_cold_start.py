"""Fast by default and the cold start (issue 17): numba is a default dependency where it
has wheels, and the ``tiegrad`` command compiles its kernels in child processes without
changing what a run computes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import _tiegrad_launcher as launcher
from tiegrad import _numba
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
        self.command, self.env, self.session = command, kw["env"], kw["start_new_session"]
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


def test_launcher_starts_one_single_threaded_child_per_kernel_module(monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", _FakePopen)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(launcher.os, "getloadavg", lambda: (0.5, 0.5, 0.5), raising=False)
    children = launcher.start_precompile(["train", "--steps", "3"])
    assert set(children) == set(launcher.PRECOMPILED)
    for module, child in children.items():
        assert child.command == [sys.executable, "-m", "tiegrad.train.precompile", module]
        assert all(child.env[name] == "1" for name in launcher.CHILD_THREADS)
        assert child.session  # the terminal's Ctrl-C reaches the run, not the children


def test_launcher_starts_no_child_without_an_idle_cpu(monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", _FakePopen)
    monkeypatch.setattr(launcher.os, "getloadavg", lambda: (1.5, 0.5, 0.5), raising=False)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert launcher.start_precompile(["train"]) == {}  # busy: the command compiles itself
    monkeypatch.setattr(launcher.os, "getloadavg", lambda: (0.0, 0.0, 0.0), raising=False)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert launcher.start_precompile(["train"]) == {}  # one CPU


def test_first_use_of_a_module_waits_once_and_before_loading(monkeypatch):
    events = []
    monkeypatch.setattr(_numba, "_load", lambda module: events.append(("load", module)) or module)
    monkeypatch.setattr(_numba, "ENABLED", True)
    _numba.before_first_use("pkg.a", lambda: events.append(("wait", "pkg.a")))
    assert _numba.kernels("pkg.b") == "pkg.b"  # another module does not run a's wait
    assert _numba.kernels("pkg.a") == "pkg.a"
    assert _numba.kernels("pkg.a") == "pkg.a"
    assert events == [("load", "pkg.b"), ("wait", "pkg.a"), ("load", "pkg.a"), ("load", "pkg.a")]
    assert _numba._first_use == {}


def test_no_wait_without_compiled_kernels(monkeypatch):
    waits = []
    monkeypatch.setattr(_numba, "ENABLED", False)
    monkeypatch.setattr(_numba, "_first_use", {"pkg.a": lambda: waits.append(1)})
    assert _numba.kernels("pkg.a") is None
    assert waits == []


def _child(code):
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_failed_or_stuck_child_only_costs_time(monkeypatch):
    failed = _child("raise SystemExit(3)")
    precompile._waiter(failed)()  # returns: the command compiles what is missing itself
    assert failed.returncode == 3
    monkeypatch.setattr(precompile, "WAIT_S", 0.2)
    stuck = _child("import time; time.sleep(60)")
    precompile._waiter(stuck)()
    assert stuck.returncode is not None  # killed after WAIT_S


def test_stop_kills_the_children_still_running():
    running, done = _child("import time; time.sleep(60)"), _child("pass")
    done.wait()
    precompile.stop({"a": running, "b": done})
    assert running.returncode is not None and done.returncode == 0


def test_attach_without_compiled_kernels_stops_the_children(monkeypatch):
    monkeypatch.setattr(_numba, "ENABLED", False)
    running = _child("import time; time.sleep(60)")
    precompile.attach({"tiegrad.optim.kernels": running})
    assert running.returncode is not None
    assert "tiegrad.optim.kernels" not in _numba._first_use


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
        "assert n._first_use == {}\n"
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
    # The command with an empty cache: its children compile, the run itself compiles
    # nothing (numba's cache log of the run's own process shows no save).
    out, cold = _train(WITH_CHILDREN, tmp_path, tmp_path / "cache", "cold")
    assert "data saved" not in out, out
    assert "data loaded" in out
    # Without children (the package's entry point) from the filled cache: the same bits.
    _, cached = _train(WITHOUT_CHILDREN, tmp_path, tmp_path / "cache", "cached")
    assert [(r["train_loss"], r["grad_norm"]) for r in cold] == [
        (r["train_loss"], r["grad_norm"]) for r in cached
    ]
