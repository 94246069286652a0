"""The benchmark runner (issue 9) as a smoke test: every row is produced, no timing asserted.

The quick run alternates each workload's tiegrad and PyTorch sides for a couple of
steps; the first-step probes must agree (same data, same initial weights, same
hyperparameters), which is what makes the ratios meaningful.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from benchmarks import runner  # noqa: E402
from benchmarks.workloads import WORKLOADS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAIRS = {
    "W1": {("tiegrad", "torch")},
    "W2": {("tiegrad", "torch")},
    "W3": {("tiegrad", "torch")},
    "W4": {("tiegrad", "torch"), ("tiegrad", "torch fused")},
    "W5": {("tiegrad", "torch")},
    "G1": {("tiegrad", "torch")},
    "G2": {("tiegrad", "torch")},
    "L1": {("tiegrad", "torch")},
    "L2": {("tiegrad", "torch")},
    "G3": {("tiegrad", "torch")},
    "M1": {("tiegrad recompute", "torch"), ("tiegrad recompute", "torch checkpointing")},
    "M2": {("tiegrad", "torch")},
    "D1": {("tiegrad", "torch DDP")},
    "D2": {
        (tiegrad, torch)
        for tiegrad in ("tiegrad stage 1", "tiegrad stage 2", "tiegrad unsharded")
        for torch in ("torch DDP + ZeRO", "torch DDP")
    },
}


@pytest.fixture(scope="module")
def quick_report():
    return runner.run(quick=True, rss=False, log=lambda _: None)


def test_quick_run_produces_every_row(quick_report):
    by_id = {w["id"]: w for w in quick_report["workloads"]}
    assert list(by_id) == [
        "W1",
        "W2",
        "W3",
        "W4",
        "W5",
        "G1",
        "G2",
        "L1",
        "L2",
        "G3",
        "M1",
        "M2",
        "D1",
        "D2",
    ]
    for wid, pairs in PAIRS.items():
        rows = by_id[wid]["rows"]
        got = {(r["tiegrad"], r["torch"]) for r in rows}
        assert pairs <= got, wid
        for r in rows:
            assert r["tiegrad_ms"] > 0 and r["torch_ms"] > 0
            lo, hi = r["tiegrad_range_ms"]
            assert lo <= r["tiegrad_ms"] <= hi
            assert r["ratio"] == pytest.approx(r["tiegrad_ms"] / r["torch_ms"])
            assert r["tiegrad_rss_mb"] is None  # rss=False
        for side in by_id[wid]["sides"].values():
            assert len(side["times_ms"]) == runner.QUICK_STEPS[1]


def test_quick_run_sides_agree_on_the_first_step(quick_report):
    # Same data, weights and hyperparameters: a mismatched model shows up here.
    for w in quick_report["workloads"]:
        assert w["warnings"] == [], w["warnings"]
        probes = [s["first_probe"] for s in w["sides"].values() if s["framework"] != "reference"]
        assert len(probes) >= 2 and all(math.isfinite(p) for p in probes)


def test_optional_device_row_is_either_measured_or_skipped_with_a_reason(quick_report):
    (w1,) = [w for w in quick_report["workloads"] if w["id"] == "W1"]
    device = "tiegrad torch:cpu"
    if device in w1["sides"]:
        assert (device, "torch") in {(r["tiegrad"], r["torch"]) for r in w1["rows"]}
    else:
        assert w1["skipped"][device]


def test_w5_reports_the_gemm_bound(quick_report):
    (w5,) = [w for w in quick_report["workloads"] if w["id"] == "W5"]
    extra = w5["extras"]
    assert extra["step_gflop"] == pytest.approx(8 * 2 * 512 * 1024 * 1024 / 1e9)
    assert extra["gemm_bound_ms"] > 0 and extra["gemm_gflops"] > 0
    assert set(extra["ratio_to_gemm_bound"]) == {"tiegrad", "torch"}
    assert extra["gemm_bound_ms"] == w5["sides"]["GEMM-only"]["median_ms"]  # timed alongside
    assert "GEMM-only lower bound" in w5["notes"][0]


def test_m2_reports_the_three_products_bound_and_the_traced_peak(quick_report):
    (m2,) = [w for w in quick_report["workloads"] if w["id"] == "M2"]
    extra = m2["extras"]
    assert extra["gemm_bound_ms"] == m2["sides"]["3 GEMMs"]["median_ms"]  # timed alongside
    assert set(extra["ratio_to_gemm_bound"]) == {"tiegrad", "torch"}
    # the tiny head's logits are 250 KiB: what the op holds beyond its inputs and
    # gradients is a chunk of them and a few vectors
    assert 0 < extra["tiegrad_peak_beyond_inputs_and_gradients_mib"] < 1
    assert "tracemalloc" in m2["notes"][1]


def test_table_has_a_row_per_pair(quick_report):
    table = runner.format_table(quick_report)
    n_rows = sum(len(w["rows"]) for w in quick_report["workloads"])
    ids = tuple(f"| {w['id']} " for w in quick_report["workloads"])
    body = [line for line in table.splitlines() if line.startswith(ids)]
    assert len(body) == n_rows
    assert "quick smoke run" in table


def test_cli_quick_writes_the_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    cmd = ["run", "--quick", "--no-rss", "--only", "W2", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", *cmd],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| W2 small-MLP | tiegrad | torch |" in proc.stdout
    report = json.loads(out.read_text())
    assert [w["id"] for w in report["workloads"]] == ["W2"]
    assert report["quick"] is True and report["machine"]["threads"] == 2


def test_peak_rss_of_a_side_is_measured_in_a_subprocess():
    rss = runner.measure_rss("W2", "tiegrad", quick=True)
    assert "error" not in rss, rss
    assert rss["peak_mb"] >= rss["steady_mb"]
    assert rss["step_transient_mb"] == pytest.approx(rss["peak_mb"] - rss["steady_mb"])
    assert rss["method"]


def test_cli_rejects_an_unknown_workload():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "--quick", "--only", "W9"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown workload 'W9'" in proc.stderr
    assert "W1" in proc.stderr


class _Recorder:
    def __init__(self, name, log):
        self.name, self.log, self.n = name, log, 0

    def step(self):
        self.n += 1
        self.log.append(self.name)

    def probe(self):
        return float(self.n)


def test_measure_warms_up_then_alternates_runs_abba_each_with_a_settling_step(monkeypatch):
    log: list[str] = []
    pauses: list[float] = []
    monkeypatch.setattr(runner.time, "sleep", pauses.append)
    monkeypatch.setattr(runner, "WARM_S", 0.0)  # one settling step per run
    a, b = _Recorder("a", log), _Recorder("b", log)
    sides = [runner.Side(r.name, fw, r.step, r.probe) for r, fw in ((a, "tiegrad"), (b, "torch"))]
    stats = runner.measure(sides, warmup=2, steps=3)
    runs = ["a", "b", "b", "a", "a", "b"]  # one settling and one timed step each
    assert log == ["a", "b", "a", "b"] + [name for name in runs for _ in range(2)]
    assert stats["a"].first_probe == 1.0 and len(stats["b"].times_ms) == 3
    assert pauses == [runner.SETTLE_S] * 6  # before every run
    log.clear()
    stats = runner.measure(sides, warmup=1, steps=2 * runner.RUNS + 1)
    timed = [len(stats[name].times_ms) for name in "ab"]
    assert timed == [2 * runner.RUNS + 1] * 2
    # runs of 2 timed steps, the last of 1: each run adds one settling step per side
    assert log.count("a") == 1 + timed[0] + runner.RUNS + 1
    assert log[2:5] == ["a", "a", "a"] and log[5:8] == ["b", "b", "b"]


def test_each_run_settles_with_untimed_steps_for_warm_s_after_its_pause(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(runner.time, "sleep", lambda s: None)
    now = [0.0]

    def clock():  # every reading is 30 ms after the one before
        now[0] += 0.03
        return now[0]

    monkeypatch.setattr(runner.time, "perf_counter", clock)
    a = _Recorder("a", log)
    stats = runner.measure([runner.Side("a", "tiegrad", a.step, a.probe)], warmup=1, steps=1)
    # WARM_S 0.1 s: one settling step, then more while a reading is under 0.1 s after
    # the pause's end (30, 60 and 90 ms; not 120)
    settling = len(log) - 1 - len(stats["a"].times_ms)
    assert settling == 4 and runner.WARM_S == 0.1
    assert stats["a"].times_ms == [pytest.approx(30.0)]


def test_a_failing_optional_side_is_dropped_with_its_reason_and_others_still_run():
    log: list[str] = []
    ok = _Recorder("ok", log)

    def broken():
        raise RuntimeError("no device here")

    sides = [
        runner.Side("ok", "tiegrad", ok.step, ok.probe),
        runner.Side("dev", "tiegrad", broken, ok.probe, optional=True),
    ]
    stats = runner.measure(sides, warmup=1, steps=2)
    assert list(stats) == ["ok"] and len(stats["ok"].times_ms) == 2
    assert sides[1].dropped == "RuntimeError: no device here"
    required = [runner.Side("dev", "tiegrad", broken, ok.probe)]
    with pytest.raises(RuntimeError, match="no device here"):
        runner.measure(required, warmup=1, steps=1)


def test_probe_warnings_flag_a_mismatch_only():
    def stats(probe_b):
        return {
            "tiegrad": runner.SideStats("tiegrad", "tiegrad", [1.0], 2.0),
            "torch": runner.SideStats("torch", "torch", [1.0], probe_b),
        }

    assert runner.probe_warnings("W0", stats(2.0 * (1 + 1e-6))) == []
    (w,) = runner.probe_warnings("W0", stats(2.01))
    assert "W0" in w and "tiegrad" in w and "torch" in w
    assert runner.probe_warnings("W0", stats(float("nan")))


def test_every_workload_declares_its_interface():
    for wid, module in WORKLOADS.items():
        assert module.ID == wid
        warmup, steps = module.STEPS
        assert warmup >= 1 and steps >= 1


def test_quick_run_uses_the_small_llama_and_full_run_the_smollm2_shape(monkeypatch):
    from benchmarks.workloads import l1_llama

    made = []
    monkeypatch.setattr(l1_llama, "_data", lambda shape, b, t: made.append((shape, b, t)))
    runner.workload_data(l1_llama, quick=True)
    runner.workload_data(l1_llama, quick=False)
    runner.workload_data(WORKLOADS["W2"], quick=True)  # no make_quick_data: make_data
    assert made == [
        (l1_llama.QUICK_SHAPE, l1_llama.QUICK_BATCH, l1_llama.QUICK_SEQ),
        (l1_llama.SHAPE, l1_llama.BATCH, l1_llama.SEQ),
    ]
    assert l1_llama.SHAPE == {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    }  # fmt: skip
    assert (l1_llama.BATCH, l1_llama.SEQ) == (4, 256)


def test_l1_reports_the_step_ratio_against_the_goal(quick_report):
    (l1,) = [w for w in quick_report["workloads"] if w["id"] == "L1"]
    (row,) = l1["rows"]
    assert l1["extras"]["step_ratio"] == pytest.approx(row["ratio"])
    assert l1["extras"]["step_ratio_goal"] == 0.9
    assert "rss_ratio" not in l1["extras"]  # rss=False
    assert "goal <= 0.9" in l1["notes"][0]


def test_l1_rss_ratio_is_the_ratio_of_the_sides_peaks():
    from benchmarks.workloads import l1_llama

    def side(name, peak):
        return runner.SideStats(name, name, [2.0], 1.0, {"peak_mb": peak})

    extra, (note,) = l1_llama.extras(
        {"tiegrad": side("tiegrad", 30.0), "torch": side("torch", 40.0)}
    )
    assert extra["rss_ratio"] == pytest.approx(0.75) and extra["step_ratio"] == 1.0
    assert "peak RSS ratio 0.75 (goal <= 0.8)" in note


def test_l2_generates_every_new_token_on_both_sides_and_reports_tokens_per_second(quick_report):
    from benchmarks.workloads import l2_llama_generate as l2

    (w,) = [w for w in quick_report["workloads"] if w["id"] == "L2"]
    rates = w["extras"]["tokens_per_s"]
    for name, rate in rates.items():
        assert rate == pytest.approx(l2.NEW_TOKENS / (w["sides"][name]["median_ms"] * 1e-3))
    assert w["extras"]["tokens_per_s_ratio"] == pytest.approx(1 / w["rows"][0]["ratio"])
    probes = {name: side["first_probe"] for name, side in w["sides"].items()}
    assert probes["tiegrad"] == probes["torch"]  # sums of the new token ids: the same tokens


def test_d1_reports_the_communication_share_of_both_sides(quick_report):
    (d1,) = [w for w in quick_report["workloads"] if w["id"] == "D1"]
    assert set(d1["extras"]["communication_share"]) == {"tiegrad", "torch"}
    assert {"tiegrad local", "tiegrad after backward", "torch DDP no_sync"} <= set(d1["sides"])
    assert any("communication share of the step (torch)" in n for n in d1["notes"])
    assert set(d1["extras"]["cpu_ms"]["tiegrad"]) == {"step", "after", "local"}
    assert any("tiegrad after backward (no overlap)" in n for n in d1["notes"])


def test_d2_reports_the_bytes_each_rank_holds_and_the_stages_shares(quick_report):
    (d2,) = [w for w in quick_report["workloads"] if w["id"] == "D2"]
    shares = d2["extras"]["share_of_unsharded"]
    assert shares["tiegrad stage 1"]["optimizer_state"] <= 0.55
    assert shares["tiegrad stage 2"]["optimizer_state"] <= 0.55
    assert shares["tiegrad stage 2"]["gradients"] <= 0.55
    zero = d2["extras"]["held"]["torch DDP + ZeRO"]
    unsharded = d2["extras"]["held"]["tiegrad unsharded"]
    assert len(zero) == len(unsharded) == 2 and all(m["peak_rss_mb"] > 0 for m in zero)
    assert set(d2["extras"]["ratio_to_zero"]) == {
        "tiegrad stage 1",
        "tiegrad stage 2",
        "tiegrad unsharded",
    }
