"""metrics.jsonl and metrics.csv: nothing lost on resume, a torn last line, a full disk,
and no records kept in memory (issue 22, items 6, 7 and 11); a damaged or wrong-typed
line before the last is refused with its line number and neither file is cut (issue 52)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiegrad import ConfigError
from tiegrad.train import MetricsWriter, read_metrics
from tiegrad.train.metrics import check_metrics

ROOT = Path(__file__).resolve().parents[1]


def write_rows(folder, steps, resume_step=None):
    with MetricsWriter(folder, resume_step) as w:
        for s in steps:
            w.write({"step": s, "train_loss": 1.0 / s, "elapsed": float(s)})


def test_resume_appends_after_the_kept_rows_and_never_rewrites_them(tmp_path):
    write_rows(tmp_path, range(1, 11))
    jsonl = tmp_path / "metrics.jsonl"
    inode = jsonl.stat().st_ino
    head = jsonl.read_bytes()[: jsonl.read_bytes().index(b'{"step": 7')]
    write_rows(tmp_path, range(7, 13), resume_step=6)  # rows 7-10 came after the checkpoint
    assert jsonl.stat().st_ino == inode  # the same file, cut in place: never re-created
    assert jsonl.read_bytes().startswith(head)
    assert [r["step"] for r in read_metrics(jsonl)] == list(range(1, 13))
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,train_loss")
    assert [int(r.split(",")[0]) for r in rows[1:]] == list(range(1, 13))


def test_a_torn_last_line_is_dropped_on_resume_with_a_warning(tmp_path):
    write_rows(tmp_path, range(1, 6))
    jsonl, csv = tmp_path / "metrics.jsonl", tmp_path / "metrics.csv"
    with open(jsonl, "ab") as f:
        f.write(b'{"step": 6, "train_lo')
    with open(csv, "ab") as f:
        f.write(b"6,0.16")
    assert [r["step"] for r in read_metrics(jsonl)] == [1, 2, 3, 4, 5]
    seen = []
    write_rows_notify = MetricsWriter(tmp_path, 5, notify=seen.append)
    write_rows_notify.write({"step": 6, "train_loss": 0.5})
    write_rows_notify.close()
    assert len(seen) == 2 and all("torn" in m for m in seen)  # one notice per file
    assert "metrics.jsonl" in seen[0] and "metrics.csv" in seen[1]
    assert [r["step"] for r in read_metrics(jsonl)] == [1, 2, 3, 4, 5, 6]
    assert csv.read_text().splitlines()[-2:] == ["5,0.2,,,,,5.0,,,", "6,0.5,,,,,,,,"]
    with pytest.warns(RuntimeWarning, match="torn"):  # the default notice is a warning
        with open(jsonl, "ab") as f:
            f.write(b"{")
        MetricsWriter(tmp_path, 6).close()


def test_a_damaged_line_before_the_end_names_the_file_and_line(tmp_path):
    write_rows(tmp_path, range(1, 4))
    jsonl = tmp_path / "metrics.jsonl"
    lines = jsonl.read_text().splitlines(keepends=True)
    jsonl.write_text(lines[0] + "garbage\n" + "".join(lines[1:]))
    with pytest.raises(ConfigError, match=r"metrics.jsonl: line 2 is not a JSON record"):
        MetricsWriter(tmp_path, 3)


FULL_DISK_CHILD = """
import resource, sys
from tiegrad.train import MetricsWriter
limit = int(sys.argv[2])
with MetricsWriter(sys.argv[1]) as w:  # closed as the error leaves: no file left open
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    step = 0
    while True:
        step += 1
        w.write({"step": step, "train_loss": 1.2345678, "lr": 0.001, "elapsed": step * 0.1})
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE in a child")
def test_a_full_disk_names_the_file_and_the_resume_drops_the_torn_line(tmp_path):
    """The child's file size limit (``ulimit -f``) stands for a full disk: the write that
    fails names the file, the half-written line is dropped on resume with a warning."""
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK_CHILD, str(tmp_path), "3000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("OSError: [Errno 27] cannot write the metrics file (File too large)")
    assert "metrics.jsonl" in last
    jsonl = tmp_path / "metrics.jsonl"
    assert jsonl.stat().st_size == 3000 and not jsonl.read_bytes().endswith(b"\n")
    kept = read_metrics(jsonl)
    seen = []
    MetricsWriter(tmp_path, kept[-1]["step"], notify=seen.append).close()
    assert len(seen) == 1 and "torn" in seen[0]
    assert jsonl.read_bytes().endswith(b"\n")
    assert [json.loads(x)["step"] for x in jsonl.read_text().splitlines()] == [
        r["step"] for r in kept
    ]


def test_the_writer_keeps_no_records_in_memory(tmp_path):
    w = MetricsWriter(tmp_path)
    assert not hasattr(w, "records")
    w.close()


LONG_RUN_CHILD = """
import sys
from pathlib import Path
import numpy as np
from tiegrad.data import ArrayDataset, DataLoader
from tiegrad.models import MLPClassifier
from tiegrad.optim import SGD
from tiegrad.train import Callback, Trainer

def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

class Probe(Callback):
    marks = {}
    def on_step_end(self, trainer, logs):
        if logs["step"] in (5000, 20000):
            self.marks[logs["step"]] = rss()

rng = np.random.default_rng(0)
x = rng.normal(size=(16, 4)).astype(np.float32)
y = rng.integers(0, 2, 16)
model = MLPClassifier(4, 4, 2, seed=0)
trainer = Trainer(model, SGD(model.parameters(), lr=0.01), None,
                  DataLoader(ArrayDataset(x, y), 4), max_steps=20000, run_dir=sys.argv[1],
                  progress=False, plot=False, callbacks=[Probe()])
trainer.fit()
print(Probe.marks[20000] - Probe.marks[5000])
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads RSS from /proc")
def test_rss_stays_flat_over_20k_tiny_steps(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LONG_RUN_CHILD), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=1800,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
    )
    assert proc.returncode == 0, proc.stderr
    grown = float(proc.stdout.strip().splitlines()[-1])
    print(f"RSS growth from step 5k to 20k: {grown:+.2f} MB", file=sys.stderr)
    assert grown < 2.0


# -- issue 52: a damaged or wrong-typed line is refused with its line, nothing cut ----------
def files(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_damaged_early_csv_row_is_refused_and_neither_file_is_cut(tmp_path):
    write_rows(tmp_path, range(1, 6))
    csv = tmp_path / "metrics.csv"
    lines = csv.read_text().splitlines(keepends=True)
    csv.write_text(lines[0] + lines[1] + "2,0.5,oops\n" + "".join(lines[3:]))
    before = files(tmp_path)
    for resume_step in (5, 2):  # 2: metrics.jsonl alone would be cut after step 2
        with pytest.raises(ConfigError, match=r"metrics.csv: line 3 has 3 cells, expected 10"):
            MetricsWriter(tmp_path, resume_step)
        assert files(tmp_path) == before


@pytest.mark.parametrize(
    "row, what",
    [
        ("x,0.5,,,,,1.0,,,\n", "has step 'x', expected an integer >= 0"),
        ("-2,0.5,,,,,1.0,,,\n", "has step '-2'"),
        ("2,abc,,,,,1.0,,,\n", "has train_loss 'abc', expected a number or an empty cell"),
        ("2,0.5,,,,,1.0,,big,\n", "has peak_rss_mb 'big', expected a number or an empty cell"),
        ("step,train_loss\n", "has 2 cells"),
    ],
)
def test_a_wrong_typed_csv_cell_is_refused_with_its_line(tmp_path, row, what):
    write_rows(tmp_path, range(1, 4))
    csv = tmp_path / "metrics.csv"
    lines = csv.read_text().splitlines(keepends=True)
    csv.write_text(lines[0] + row + "".join(lines[2:]))
    before = files(tmp_path)
    with pytest.raises(ConfigError, match=rf"metrics.csv: line 2 {re.escape(what)}"):
        MetricsWriter(tmp_path, 3)
    assert files(tmp_path) == before


@pytest.mark.parametrize(
    "change, what",
    [
        ({"step": "1"}, "has step '1', expected an integer >= 0"),
        ({"step": None}, "has step None"),
        ({"step": True}, "has step True"),
        ({"step": 2.0}, "has step 2.0"),
        ({"train_loss": "low"}, "has train_loss 'low', expected a number"),
        ({"elapsed": [1]}, "has elapsed [1]"),
        ({"lr": False}, "has lr False"),
    ],
)
def test_a_wrong_typed_field_in_metrics_jsonl_is_refused_with_its_line(tmp_path, change, what):
    """Not a ``TypeError`` from comparing steps: a ``ConfigError`` naming file and line,
    from the reader and from a resume, which cuts neither file."""
    write_rows(tmp_path, range(1, 4))
    jsonl = tmp_path / "metrics.jsonl"
    lines = jsonl.read_text().splitlines(keepends=True)
    lines[1] = json.dumps(dict(json.loads(lines[1]), **change)) + "\n"
    jsonl.write_text("".join(lines))
    before = files(tmp_path)
    pattern = rf"metrics.jsonl: line 2 {re.escape(what)}"
    with pytest.raises(ConfigError, match=pattern):
        read_metrics(jsonl)
    with pytest.raises(ConfigError, match=pattern):
        MetricsWriter(tmp_path, 1)
    assert files(tmp_path) == before


def test_a_record_without_a_step_is_refused(tmp_path):
    write_rows(tmp_path, range(1, 3))
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text('{"train_loss": 1.0}\n' + jsonl.read_text())
    with pytest.raises(ConfigError, match=r"metrics.jsonl: line 1 has step None"):
        check_metrics(tmp_path, 2)


def test_a_damaged_last_csv_row_is_dropped_with_a_notice(tmp_path):
    write_rows(tmp_path, range(1, 4))
    csv = tmp_path / "metrics.csv"
    with open(csv, "a") as f:
        f.write("4,0.2,\n")  # a whole line, but not a row: damaged where a write ends
    seen = []
    MetricsWriter(tmp_path, 3, notify=seen.append).close()
    assert len(seen) == 1 and "metrics.csv" in seen[0]
    assert [int(r.split(",")[0]) for r in csv.read_text().splitlines()[1:]] == [1, 2, 3]


def test_non_finite_values_and_blank_lines_are_kept(tmp_path):
    with MetricsWriter(tmp_path) as w:
        w.write({"step": 1, "train_loss": float("nan"), "grad_norm": float("inf")})
        w.write({"step": 2, "val_loss": 1.0, "val_ppl": float("inf")})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("\n")
    before = files(tmp_path)
    check_metrics(tmp_path, 2)
    MetricsWriter(tmp_path, 2).close()
    assert files(tmp_path) == before
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
