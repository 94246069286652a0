"""Recomputation and peak memory in training: the ``Trainer``'s ``recompute`` option, the
command's ``--recompute`` (kept by ``resume``, switchable there) and the
``peak_rss_mb`` / ``device_peak_mb`` fields of the run's metrics."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from test_cli import TEXT
from test_untrusted_input import cli

from tiegrad import ConfigError
from tiegrad.data import ArrayDataset, DataLoader
from tiegrad.models import MLPClassifier, TiedLM
from tiegrad.optim import AdamW
from tiegrad.train import Trainer, read_metrics
from tiegrad.train.memory import device_peak_mb, peak_memory, peak_rss_mb
from tiegrad.train.metrics import CSV_COLUMNS, EARLIER_COLUMNS, MetricsWriter

VOCAB, T = 30, 8


def _trainer(run_dir, recompute: bool) -> tuple[Trainer, TiedLM]:
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (8, T))
    y = np.roll(x, -1, axis=1)
    model = TiedLM(VOCAB, d_model=8, n_layers=2, n_heads=2, max_seq_len=T, dropout=0.1)
    trainer = Trainer(
        model,
        AdamW(model.parameters(), lr=1e-2),
        train_data=DataLoader(ArrayDataset(x, y), batch_size=4),
        max_steps=3,
        run_dir=run_dir,
        progress=False,
        plot=False,
        recompute=recompute,
    )
    return trainer, model


def test_the_trainer_recomputes_with_the_same_steps_and_records_peak_memory(tmp_path):
    plain, plain_model = _trainer(tmp_path / "plain", False)
    again, model = _trainer(tmp_path / "again", True)
    assert model.recompute is True and plain_model.recompute is False
    plain.fit()
    again.fit()
    for path, p in plain_model.named_parameters():  # dropout on: the same three steps
        assert np.array_equal(p.value, model.get_parameter(path).value), path
    records = read_metrics(tmp_path / "again" / "metrics.jsonl")
    losses = [r["train_loss"] for r in read_metrics(tmp_path / "plain" / "metrics.jsonl")]
    assert [r["train_loss"] for r in records] == losses
    assert all(r["peak_rss_mb"] > 1 for r in records)  # MiB: the interpreter alone is more
    assert all("device_peak_mb" not in r for r in records)  # the host: no device peak
    with open(tmp_path / "again" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert [float(r["peak_rss_mb"]) for r in rows] == [r["peak_rss_mb"] for r in records]
    assert all(r["device_peak_mb"] == "" for r in rows)


def test_peak_memory_figures():
    rss = peak_rss_mb()
    assert rss is not None and peak_rss_mb() >= rss > 1
    block = np.ones(64 * 2**20 // 8)  # 64 MiB touched: the peak grows to hold it
    assert peak_rss_mb() >= rss + 32 or peak_rss_mb() > 64
    del block
    assert device_peak_mb(None) is None
    assert peak_memory(None)["device_peak_mb"] is None


def test_torch_cpu_has_no_device_peak():
    pytest.importorskip("torch")
    from tiegrad.backend import device_backend

    assert device_peak_mb(device_backend("torch:cpu")) is None


def test_a_cuda_device_reports_torchs_peak():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from tiegrad.backend import device_backend

    backend = device_backend("cuda")
    block = torch.ones(2**20, device=backend.torch_device)  # 4 MiB
    assert device_peak_mb(backend) >= 4
    assert peak_memory(backend)["device_peak_mb"] == device_peak_mb(backend)
    del block


@pytest.mark.parametrize(
    "model, recompute, what",
    [
        (TiedLM(VOCAB, d_model=8, n_layers=1, n_heads=2, max_seq_len=T), "yes", "True or False"),
        (MLPClassifier(4, 8, 2), True, "gradient_checkpointing_enable"),
    ],
)
def test_the_trainer_refuses_a_bad_recompute_and_changes_nothing(model, recompute, what):
    x = np.zeros((4, T), np.int64)
    with pytest.raises(ConfigError, match=what):
        Trainer(
            model,
            AdamW(model.parameters()),
            train_data=DataLoader(ArrayDataset(x, x), batch_size=2),
            max_steps=1,
            progress=False,
            recompute=recompute,
        )
    assert getattr(model, "recompute", False) is False


def test_a_metrics_csv_begun_before_the_memory_columns_keeps_its_columns(tmp_path):
    header = ",".join(EARLIER_COLUMNS)
    (tmp_path / "metrics.csv").write_text(f"{header}\n1,0.5,,,,,1.0,\n2,0.4,,,,,2.0,\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    writer = MetricsWriter(tmp_path, 1)
    writer.write({"step": 2, "train_loss": 0.3, "elapsed": 2.5, "peak_rss_mb": 100.0})
    writer.close()
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines == [header, "1,0.5,,,,,1.0,", "2,0.3,,,,,2.5,"]
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["peak_rss_mb"] == 100.0
    MetricsWriter(tmp_path, 2).close()  # and it resumes again


CLI = [
    "train", "--text", "text.txt", "--steps", "4", "--checkpoint-every", "2",
    "--sample-every", "0", "--d-model", "8", "--layers", "2", "--heads", "2",
    "--seq-len", "8", "--batch-size", "2", "--eval-batches", "1", "--dropout", "0.1",
    "--no-progress",
]  # fmt: skip


def test_the_command_trains_with_recompute_and_resume_keeps_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text(TEXT)
    code, out, err = cli(capsys, *CLI, "--run", "plain")
    assert code == 0, err
    code, out, err = cli(capsys, *CLI, "--recompute", "--run", "rc")
    assert code == 0, err
    assert "recompute=True" in out
    assert json.loads((tmp_path / "rc" / "config.json").read_text())["recompute"] is True

    def train_records(run: str) -> list[dict]:
        return [r for r in read_metrics(tmp_path / run / "metrics.jsonl") if "train_loss" in r]

    losses = [r["train_loss"] for r in train_records("plain")]
    assert [r["train_loss"] for r in train_records("rc")] == losses  # the same gradients
    assert all(r["peak_rss_mb"] > 1 for r in train_records("rc"))
    code, out, err = cli(capsys, "resume", "rc", "--steps", "6")
    assert code == 0, err
    assert "recompute=True" in out  # the run's setting, kept
    code, out, err = cli(capsys, "resume", "rc", "--steps", "8", "--no-recompute")
    assert code == 0, err
    assert "recompute" not in out
    assert json.loads((tmp_path / "rc" / "config.json").read_text())["recompute"] is False
    assert [r["step"] for r in train_records("rc")] == list(range(1, 9))
