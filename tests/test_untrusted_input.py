"""Issue 22: untrusted files and bad arguments give clean errors and change nothing (C6, C9).

One test group per item: the model config of ``tiegrad sample --checkpoint`` (1),
constructor arguments (2), impossible optimizer state and non-finite values (3),
resource limits (4), huge keys, lone surrogates and bad seeds (5), the all-or-nothing
``Trainer.load_checkpoint`` (8), temporaries (10) and 64-bit config integers (12).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import numpy as np
import pytest
from test_checkpoint_file import read_doc, write_doc

import tiegrad
from tiegrad import CheckpointError, Param, ParamList, TiegradError
from tiegrad.checkpoint import fileio
from tiegrad.cli import main
from tiegrad.data import TextDataset, Vocab
from tiegrad.models import GPT2, MLPClassifier, SharedBlockLM, SiameseEncoder, TiedLM
from tiegrad.nn import (
    MLP,
    Conv2d,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    MaxPool2d,
    MultiHeadAttention,
    TransformerBlock,
)
from tiegrad.optim import SGD, Adagrad, AdamW, schedules
from tiegrad.train import Trainer
from tiegrad.train.config import resolve

TEXT = "".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 5}\n" for i in range(40))
VOCAB = Vocab.build(TEXT)
SMALL = dict(vocab_size=VOCAB.size, d_model=8, n_layers=1, n_heads=2, max_seq_len=6)


def header_file(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def values(plist: ParamList) -> list[bytes]:
    return [p.value.tobytes() for p in plist]


def cli(capsys, *args) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(result, *fragments: str) -> str:
    code, _, err = result
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("tiegrad: error: "), err
    for fragment in fragments:
        assert fragment in err, err
    return err


# -- 1: tiegrad sample --checkpoint validates the model config before building -----------------
def sample_file(tmp_path, config: dict, vocab: Vocab = VOCAB):
    """The weights of a valid SMALL TiedLM under a model config of the caller's choosing."""
    path = tmp_path / "crafted.safetensors"
    extra = {"model": {"class": "TiedLM", "config": config}, "vocab": vocab.to_dict()}
    tiegrad.save(path, TiedLM(**SMALL), extra=extra)
    return path


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"evil": 1}, "unknown argument(s) 'evil'"),
        ({"vocab_size": None}, "missing argument(s) 'vocab_size'"),
        ({"d_model": "16"}, "d_model must be an integer"),
        ({"d_model": -16}, "d_model must be >= 1"),
        ({"n_heads": 3}, "must be a multiple of n_heads=3"),
        ({"dtype": "int8"}, "floating dtype"),
        ({"n_layers": 10**9}, "implies 12000000005 slots"),
        ({"vocab_size": 10**12}, "parameters"),
        ({"d_model": 16, "n_heads": 2}, "the file holds 17 slots"),
        ({"dtype": "float64"}, "bytes"),
        ({"vocab_size": VOCAB.size + 1, "max_seq_len": 5}, "vocab_size is"),
    ],
)
def test_sample_refuses_a_bad_model_config_before_building(
    tmp_path, capsys, monkeypatch, change, fragment
):
    config = {k: v for k, v in {**SMALL, **change}.items() if v is not None}
    path = sample_file(tmp_path, config)
    built = []
    monkeypatch.setattr("tiegrad.train.job.build_model", lambda kw: built.append(kw))
    result = cli(capsys, "sample", "--checkpoint", path, "--tokens", 3)
    assert_one_line_error(result, f"checkpoint {path}", fragment)
    assert built == []


def test_sample_accepts_a_matching_config(tmp_path, capsys):
    path = sample_file(tmp_path, TiedLM(**SMALL).config)
    code, out, err = cli(capsys, "sample", "--checkpoint", path, "--tokens", 4)
    assert code == 0, err
    assert len(out) >= 4


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (TiedLM, SMALL),
        (TiedLM, dict(vocab_size=11, d_model=12, n_layers=3, n_heads=3, mlp_ratio=3)),
        (SharedBlockLM, dict(vocab_size=7, d_model=8, n_heads=2, n_repeats=5, max_seq_len=9)),
        (GPT2, dict(vocab_size=13, n_positions=9, n_embd=8, n_layer=2, n_head=2)),
        (
            GPT2,
            dict(
                vocab_size=13,
                n_positions=9,
                n_embd=8,
                n_layer=1,
                n_head=4,
                n_inner=5,
                tie_word_embeddings=False,
            ),
        ),
    ],
)
def test_layout_size_is_the_built_model(cls, kwargs):
    model = cls(**kwargs)
    assert cls.layout_size(cls.check_config(model.config)) == (
        len(model.param_list()),
        model.num_parameters(),
    )


# -- 2: constructors and functions name the bad argument ---------------------------------------
def _params():
    return TiedLM(**SMALL).parameters()


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: TiedLM(vocab_size=-3), "vocab_size must be >= 1"),
        (lambda: TiedLM(vocab_size=20, d_model=0), "d_model must be >= 1"),
        (lambda: TiedLM(vocab_size="20"), "vocab_size must be an integer"),
        (lambda: TiedLM(vocab_size=0), "vocab_size"),
        (lambda: TiedLM(vocab_size=20, n_layers=-1), "n_layers"),
        (lambda: TiedLM(vocab_size=20, max_seq_len=0), "max_seq_len"),
        (lambda: TiedLM(vocab_size=20, dropout=2.0), "dropout"),
        (lambda: TiedLM(vocab_size=20, seed=-1), "seed"),
        (lambda: TiedLM(vocab_size=20, seed=2**70), "seed must be < 2**63"),
        (lambda: SharedBlockLM(vocab_size=20, n_repeats=0), "n_repeats"),
        (lambda: MLPClassifier(0, 4, 2), "in_features"),
        (lambda: MLPClassifier(3, [4, -1], 2), "hidden[1]"),
        (lambda: MLPClassifier(3, "4", 2), "hidden"),
        (lambda: MLPClassifier(3, 4, 2, activation="nope"), "activation"),
        (lambda: SiameseEncoder(-1), "in_features"),
        (lambda: SiameseEncoder(3, margin=0), "margin"),
        (lambda: Linear(0, 3), "in_features"),
        (lambda: Linear(3, 2.5), "out_features"),
        (lambda: Embedding(-2, 3), "num_embeddings"),
        (lambda: LayerNorm("8"), "dim"),
        (lambda: LayerNorm(8, eps=0), "eps"),
        (lambda: Dropout("0.5"), "p must be a real number"),
        (lambda: MLP(3, None, 2), "hidden"),
        (lambda: MultiHeadAttention(8, 0), "n_heads"),
        (lambda: TransformerBlock(8, 2, mlp_ratio=0), "mlp_ratio"),
        (lambda: Conv2d(1, 2, 0), "kernel_size"),
        (lambda: Conv2d(1, 2, 3, padding=-1), "padding"),
        (lambda: MaxPool2d(2, stride=0), "stride"),
        (lambda: tiegrad.load(None, TiedLM(**SMALL)), "checkpoint path"),
        (lambda: tiegrad.inspect(None), "checkpoint path"),
        (lambda: tiegrad.save("x.safetensors", TiedLM(**SMALL), optimizer=object()), "optimizer"),
        (lambda: tiegrad.save("x.safetensors", TiedLM(**SMALL), schedule=3), "schedule"),
        (lambda: AdamW(None), "params"),
        (lambda: SGD(5, lr=0.1), "params"),
        (lambda: TextDataset(123, 8), "text must be a str or bytes"),
        (lambda: TextDataset(TEXT, 8, val_fraction="0.1"), "val_fraction"),
        (
            lambda: Trainer(
                TiedLM(**SMALL),
                AdamW(_params()),
                train_data=TextDataset(TEXT, 4).loader("train", 2),
                val_data=5,
                max_steps=1,
            ),
            "val_data",
        ),
    ],
)
def test_bad_arguments_raise_a_tiegrad_error_naming_them(make, fragment, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TiegradError) as info:
        make()
    assert fragment in str(info.value)
    assert not os.path.exists("x.safetensors")


# -- 3: optimizer state that cannot occur, non-finite parameters -------------------------------
def stepped(opt_cls, **hp):
    w = Param(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), name="w")
    b = Param(np.zeros(3, np.float32), name="b")
    plist = ParamList([w, b])
    opt = opt_cls(plist, **hp)
    opt.step([np.full((2, 3), 0.5, np.float32), np.ones(3, np.float32)])
    return plist, opt


class Frozen:
    """An object whose state_dict is a fixed dict (how a damaged file's state is written)."""

    def __init__(self, sd):
        self.sd = sd

    def state_dict(self):
        return self.sd


def _negate(sd, name):
    sd["state"][0][name] = -np.abs(sd["state"][0][name]) - 1


def _nan(sd, name):
    sd["state"][0][name] = np.full_like(sd["state"][0][name], np.nan)


def _swap(sd, _):
    s = sd["state"][0]
    s["exp_avg"], s["exp_avg_sq"] = s["exp_avg_sq"], -np.abs(s["exp_avg"]) - 0.5


def _below_max(sd, _):
    s = sd["state"][0]
    s["max_exp_avg_sq"] = s["exp_avg_sq"] * 0.5


@pytest.mark.parametrize(
    "opt_cls, hp, damage, name, fragment",
    [
        (AdamW, {}, _negate, "exp_avg_sq", "are negative"),
        (AdamW, {}, _nan, "exp_avg", "NaN or infinite"),
        (AdamW, {}, _swap, "exp_avg_sq", "swapped"),
        (AdamW, {"amsgrad": True}, _below_max, "max_exp_avg_sq", "below 'exp_avg_sq'"),
        (Adagrad, {}, _negate, "sum", "are negative"),
        (SGD, {"lr": 0.1, "momentum": 0.9}, _nan, "momentum_buffer", "NaN or infinite"),
    ],
)
def test_impossible_optimizer_state_is_refused_with_the_slot(
    tmp_path, opt_cls, hp, damage, name, fragment
):
    plist, opt = stepped(opt_cls, **hp)
    sd = opt.state_dict()
    damage(sd, name)
    path = tmp_path / "bad.safetensors"
    tiegrad.save(path, plist, optimizer=Frozen(sd))
    fresh, target = stepped(opt_cls, **hp)
    before, state = values(fresh), target.state_dict()
    with pytest.raises(CheckpointError) as info:
        tiegrad.load(path, fresh, optimizer=target)
    message = str(info.value)
    assert f"state {name!r} of slot 0" in message and fragment in message, message
    assert values(fresh) == before
    after = target.state_dict()
    assert after["step_count"] == state["step_count"]
    assert all(np.array_equal(after["state"][0][k], v) for k, v in state["state"][0].items())
    with pytest.raises(CheckpointError, match=f"state {name!r} of slot 0"):
        target.load_state_dict(sd)  # the same check without a file


@pytest.mark.parametrize(
    "opt_cls, hp, name",
    [(AdamW, {}, "exp_avg_sq"), (AdamW, {"amsgrad": True}, "max_exp_avg_sq"), (Adagrad, {}, "sum")],
)
def test_a_sum_of_squares_that_overflowed_saves_and_resumes(tmp_path, opt_cls, hp, name):  # C9
    w = Param(np.ones(3, np.float16), name="w")
    opt = opt_cls(ParamList([w]), lr=0.01, eps=1e-4, **hp)
    opt.step([np.array([300.0, 1.0, -300.0], np.float16)])  # 300**2 overflows float16
    assert np.isinf(opt.state_dict()["state"][0][name]).tolist() == [True, False, True]
    path = tmp_path / "inf.safetensors"
    tiegrad.save(path, ParamList([w]), optimizer=opt)
    w2 = Param(np.ones(3, np.float16), name="w")
    opt2 = opt_cls(ParamList([w2]), lr=0.01, eps=1e-4, **hp)
    tiegrad.load(path, ParamList([w2]), optimizer=opt2)
    for o in (opt, opt2):
        o.step([np.full(3, 0.5, np.float16)])
    np.testing.assert_array_equal(w2.value, w.value)
    sd = opt2.state_dict()
    sd["state"][0][name] = np.where(np.isinf(sd["state"][0][name]), -np.inf, 1.0).astype("f2")
    with pytest.raises(CheckpointError, match=f"'{name}' of slot 0: 2 of 3 values are NaN or -inf"):
        opt2.load_state_dict(sd)


def test_a_state_dict_with_an_empty_layout_is_refused_by_name():  # C6
    _, opt = stepped(AdamW)
    sd = opt.state_dict()
    sd["layout"] = []
    with pytest.raises(CheckpointError, match="the state is for 0 slots, this optimizer has 2"):
        opt.load_state_dict(sd)


def test_a_schedule_of_another_kind_is_refused_before_the_optimizer_changes(tmp_path):  # C6
    plist, opt = stepped(AdamW)
    path = tmp_path / "step_lr.safetensors"
    tiegrad.save(path, plist, optimizer=opt, schedule=schedules.StepLR(opt, step_size=2))
    fresh, target = stepped(AdamW)
    target.step([np.full((2, 3), 1e20, np.float32), np.ones(3, np.float32)])  # +inf moments
    before = target.state_dict()
    schedule = schedules.ExponentialLR(target, gamma=0.5)
    with pytest.raises(CheckpointError, match="'StepLR' schedule, this one is 'ExponentialLR'"):
        tiegrad.load(path, fresh, optimizer=target, schedule=schedule)
    after = target.state_dict()
    assert after["step_count"] == before["step_count"] == 2
    assert after["param_groups"] == before["param_groups"]
    for slot, entry in before["state"].items():
        for name, value in entry.items():
            np.testing.assert_array_equal(after["state"][slot][name], value)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_parameters_load_only_when_allowed(tmp_path, bad):
    plist, _ = stepped(SGD, lr=0.1)
    path = tmp_path / "nan.safetensors"
    tiegrad.save(path, plist)
    tensors, doc = read_doc(path)
    tensors["param/w"][1, 2] = bad
    write_doc(path, tensors, doc)
    fresh, _ = stepped(SGD, lr=0.1)
    before = values(fresh)
    with pytest.raises(CheckpointError, match=r"'param/w' \(slot 'w'\) holds 1 non-finite value"):
        tiegrad.load(path, fresh)
    assert values(fresh) == before
    tiegrad.load(path, fresh, allow_nonfinite=True)
    assert fresh[0].value[1, 2] == bad or np.isnan(fresh[0].value[1, 2])


# -- 4: resource limits ------------------------------------------------------------------------
def run_limited(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``code`` in a child limited to 3 GiB of address space and ``timeout`` seconds."""

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
    )


def test_non_regular_files_are_refused_before_reading(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    code = (
        "import tiegrad\n"
        f"for path in ['/dev/zero', {str(fifo)!r}, {str(tmp_path)!r}]:\n"
        "    try:\n"
        "        tiegrad.inspect(path)\n"
        "    except tiegrad.CheckpointError as e:\n"
        "        print(e)\n"
    )
    proc = run_limited(code, timeout=30)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3
    assert "/dev/zero: not a regular file" in lines[0]
    assert f"{fifo}: not a regular file" in lines[1]
    assert str(tmp_path) in lines[2]


def test_a_header_much_larger_than_the_data_is_refused_unparsed(tmp_path):
    path = tmp_path / "padded.safetensors"
    raw = b"{" + b" " * (fileio.HEADER_ALLOWANCE + 10) + b"}"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(CheckpointError, match="exceeds"):
        tiegrad.inspect(path)


def test_tensor_and_slot_counts_are_bounded_by_the_data(tmp_path):
    n = fileio.ENTRY_ALLOWANCE + 1
    path = tmp_path / "many.safetensors"
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(n)}
    header_file(path, header)
    with pytest.raises(CheckpointError, match=f"{n} tensors in the header, more than the {n - 1}"):
        tiegrad.inspect(path)
    tiegrad.save(path, ParamList([Param(np.zeros(2, np.float32), name="a")]))
    tensors, doc = read_doc(path)
    slot = dict(doc["slots"][0], requires_grad=False, canonical=None, storage=0)
    doc["slots"] += [dict(slot, path=f"s{i}") for i in range(n)]
    write_doc(path, tensors, doc)
    with pytest.raises(CheckpointError, match=f"lists {n + 1} slots, more than the {n - 1}"):
        tiegrad.inspect(path)


def _scalars_with_adam(path):
    plist = ParamList([Param(np.float32(i), name=f"p{i}") for i in range(1500)])
    opt = AdamW(plist)
    opt.step([np.float32(1.0)] * 1500)  # 1500 slots, 4500 tensors of 4 bytes
    tiegrad.save(path, plist, optimizer=opt)


@pytest.mark.parametrize(
    "save, message",
    [
        (_scalars_with_adam, "4500 tensors to write, more than the 4377"),
        (
            lambda path: tiegrad.save(
                path, ParamList([Param(np.zeros(1, np.float32), name="w")] * 4200)
            ),
            "4200 slots, more than the 4096",
        ),
        (
            lambda path: tiegrad.save(
                path, ParamList([Param(np.zeros(1))]), extra="x" * (fileio.HEADER_ALLOWANCE + 100)
            ),
            "header length",
        ),
    ],
)
def test_save_refuses_a_file_the_reader_would_refuse_and_keeps_the_old_one(
    tmp_path, save, message
):  # C6, C9
    path = tmp_path / "limits.safetensors"
    tiegrad.save(path, ParamList([Param(np.ones(2, np.float32), name="old")]))
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=message):
        save(path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == [path.name]


def test_layout_errors_show_a_bounded_table(tmp_path):
    big = ParamList([Param(np.zeros(1, np.float32), name=f"p{i}") for i in range(300)])
    path = tmp_path / "big.safetensors"
    tiegrad.save(path, big)
    other = ParamList([Param(np.zeros(1, np.float32), name=f"q{i}") for i in range(300)])
    with pytest.raises(CheckpointError) as info:
        tiegrad.load(path, other)
    lines = str(info.value).splitlines()
    assert len(lines) < 30
    assert "280 more rows not shown, 300 rows differ in all" in lines[-1]


# -- 5: huge keys, lone surrogates, bad seeds --------------------------------------------------
def adam_file(tmp_path):
    plist, opt = stepped(AdamW)
    path = tmp_path / "adam.safetensors"
    tiegrad.save(path, plist, optimizer=opt, rng=np.random.default_rng(0))
    return path, plist, opt


def test_a_5000_digit_state_key_is_a_clean_error(tmp_path, capsys):
    path, plist, opt = adam_file(tmp_path)
    tensors, doc = read_doc(path)
    doc["optimizer"]["state"]["1" * 5000] = doc["optimizer"]["state"].pop("0")
    write_doc(path, tensors, doc)
    with pytest.raises(CheckpointError, match="is not a slot in"):
        tiegrad.load(path, plist, optimizer=opt)
    assert_one_line_error(cli(capsys, "inspect", path), "is not a slot in")


@pytest.mark.parametrize(
    "edit",
    [
        lambda doc: doc["slots"][1].update(path="b\ud800"),
        lambda doc: doc["optimizer"].update(kind="Adam\udfff"),
        lambda doc: doc["rng"].update(bit_generator="\ud800"),
    ],
)
def test_lone_surrogates_are_a_clean_error(tmp_path, capsys, edit):
    path, plist, opt = adam_file(tmp_path)
    tensors, doc = read_doc(path)
    edit(doc)
    write_doc(path, tensors, doc)
    with pytest.raises(CheckpointError, match="lone surrogate"):
        tiegrad.load(path, plist, optimizer=opt)
    assert_one_line_error(cli(capsys, "inspect", path), "lone surrogate")


def test_a_lone_surrogate_in_the_header_is_a_clean_error(tmp_path):
    path = tmp_path / "header.safetensors"
    header_file(path, {"__metadata__": {"tiegrad": "\ud800"}})
    with pytest.raises(CheckpointError, match="the header holds a lone surrogate"):
        tiegrad.inspect(path)


def test_inspect_escapes_unprintable_names(tmp_path, capsys):
    path = tmp_path / "ansi.safetensors"
    tiegrad.save(path, ParamList([Param(np.zeros(2, np.float32), name="w\x1b[2J\n")]))
    code, out, err = cli(capsys, "inspect", path)
    assert code == 0, err
    assert "\x1b" not in out and "w\\x1b[2J\\n" in out


@pytest.mark.parametrize("seed, fragment", [(-1, ">= 0"), (2**70, "64-bit")])
def test_sample_refuses_a_bad_seed(tmp_path, capsys, seed, fragment):
    path = sample_file(tmp_path, TiedLM(**SMALL).config)
    assert_one_line_error(
        cli(capsys, "sample", "--checkpoint", path, "--seed", seed), "--seed", fragment
    )


# -- 8: Trainer.load_checkpoint is all or nothing ----------------------------------------------
def trainer(tmp_path=None):
    model = TiedLM(**SMALL)
    data = TextDataset(TEXT, 6)
    return Trainer(
        model,
        AdamW(model.parameters(), lr=1e-2),
        train_data=data.loader("train", 2),
        max_steps=3,
        progress=False,
        plot=False,
    )


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"step": "ten"}, "step must be an integer"),
        ({"bad_evals": -1}, "bad_evals must be an integer >= 0"),
        ({"batches_in_epoch": 10**6}, "batches consumed"),
        ({"best_val": "low"}, "best_val must be a finite number or null"),
        ({"elapsed": None}, "elapsed must be a finite number"),
        ({"epoch_start_rng": {"bit_generator": "MT19937"}}, "bad generator state"),
    ],
)
def test_load_checkpoint_checks_the_trainer_state_before_applying_anything(
    tmp_path, change, fragment
):
    source = trainer()
    source.fit()
    path = tmp_path / "ckpt.safetensors"
    source.save_checkpoint(path)
    tensors, doc = read_doc(path)
    doc["extra"]["trainer"].update(change)
    write_doc(path, tensors, doc)
    target = trainer()
    plist = target.model.param_list()
    before = (values(plist), target.optimizer.step_count, target.step)
    rng_before = target.session.rng.bit_generator.state
    with pytest.raises(CheckpointError, match=fragment):
        target.load_checkpoint(path)
    assert (values(plist), target.optimizer.step_count, target.step) == before
    assert target.session.rng.bit_generator.state == rng_before


# -- 10: temporaries ---------------------------------------------------------------------------
def test_stale_temporaries_of_the_target_are_removed_at_the_next_save(tmp_path):
    plist = ParamList([Param(np.ones(3, np.float32), name="a")])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid = int(dead.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        old = time.time() - 3600
        names = {
            "stale": f".ckpt.safetensors.{dead_pid}.0123abcd.tmp",
            "live writer": f".ckpt.safetensors.{live.pid}.0123abcd.tmp",
            "other target": f".other.safetensors.{dead_pid}.0123abcd.tmp",
            "new": f".ckpt.safetensors.{dead_pid}.fedcba98.tmp",
        }
        for key, name in names.items():
            (tmp_path / name).write_bytes(b"x" * 100)
            if key != "new":
                os.utime(tmp_path / name, (old, old))
        tiegrad.save(tmp_path / "ckpt.safetensors", plist)
    finally:
        live.kill()
        live.wait()
    left = set(os.listdir(tmp_path))
    assert names["stale"] not in left
    assert {names["live writer"], names["other target"], names["new"]} <= left


@pytest.mark.parametrize("length", [236, 250, 255])
def test_a_long_target_name_saves_and_loads(tmp_path, length):
    plist = ParamList([Param(np.arange(3, dtype=np.float32), name="a")])
    path = tmp_path / ("c" * (length - len(".safetensors")) + ".safetensors")
    tiegrad.save(path, plist)
    target = ParamList([Param(np.zeros(3, np.float32), name="a")])
    tiegrad.load(path, target)
    assert values(target) == values(plist)
    assert os.listdir(tmp_path) == [path.name]


# -- 12: 64-bit integers in configurations -----------------------------------------------------
def test_config_integers_are_64_bit(tmp_path):
    toml = tmp_path / "big.toml"
    toml.write_text("steps = 100000000000000000000000000\n")
    with pytest.raises(tiegrad.ConfigError, match="'steps'.*64-bit integer"):
        resolve(toml)
    with pytest.raises(tiegrad.ConfigError, match="--seed: expected a 64-bit integer"):
        resolve(None, {"seed": 2**70}, {"seed": "--seed"})
    assert resolve(None, {"seed": 2**63 - 1})["seed"] == 2**63 - 1


# -- a seeded fuzz of the schema: 30 random values at random places --------------------------
ODD_VALUES = [None, -1, 0, 10**30, 2**63, "x", "", [], {}, "\ud800", 1e308, True, [1, [2]], "\x1b"]


def _places(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _places(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            yield from _places(v, (*prefix, i))


def test_random_schema_values_give_checkpoint_errors_or_load_unchanged(tmp_path):
    path, plist, opt = adam_file(tmp_path)
    tensors, doc = read_doc(path)
    places = [p for p in _places(doc) if p]
    rng = np.random.default_rng(2)
    outcomes = set()
    for k in range(30):
        edited = json.loads(json.dumps(doc))
        place = places[rng.integers(len(places))]
        holder = edited
        for step in place[:-1]:
            holder = holder[step]
        holder[place[-1]] = ODD_VALUES[k % len(ODD_VALUES)]
        write_doc(path, tensors, edited)
        fresh, target = stepped(AdamW)
        before, state = values(fresh), repr(target.state_dict())
        try:
            tiegrad.load(path, fresh, optimizer=target, rng=np.random.default_rng(1))
            outcomes.add("loaded")
        except CheckpointError:
            assert (values(fresh), repr(target.state_dict())) == (before, state), place
            outcomes.add("refused")
        try:
            text = tiegrad.inspect(path)
        except CheckpointError:
            continue
        assert all(c.isprintable() or c == "\n" for c in text), place
    assert outcomes == {"loaded", "refused"}
