"""Untrusted folders, nothing accepted silently (issue 52, items 2 and 6).

Non-finite values: a NaN, an infinity or a float64 beyond float32's range in a
transformers GPT-2 folder, a PEFT adapter or a tiegrad checkpoint is a ``TiegradError``
naming the file, the tensor and the count, the target unchanged (C6); the loaders'
``allow_nonfinite=True`` loads it. Integrity: a checkpoint holds the CRC-32 of every
tensor, so a flipped byte in its data is refused by tensor name; a file written before
(format version 1, no checksums) loads with a warning naming it.

The folders are written here by transformers, PEFT and tiegrad (tiny configurations),
then edited; nothing is downloaded.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
import zlib

import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open
from test_checkpoint_file import read_doc, write_doc

import tiegrad
from tiegrad import CheckpointError, TiegradError
from tiegrad.adapters import adapter_names, add_lora
from tiegrad.cli import main
from tiegrad.models import GPT2, TiedLM
from tiegrad.optim import AdamW

os.environ["HF_HUB_OFFLINE"] = "1"

C_ATTN = "transformer.h.0.attn.c_attn.weight"
#: Elements of the edited tensor made non-finite: three of them, as the messages count.
SPOTS = ((0, 1), (3, 0), (7, 1))
BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def state(model, optimizer=None):
    """Everything a refused load must leave as it was: each slot's path, value bytes,
    trainability and storage identity, the ties, the adapters and the optimizer state."""
    slots = [
        (path, p.value.tobytes(), p.requires_grad, id(p.storage)) for path, p in model.named_slots()
    ]
    extra = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    return slots, model.aliases(), adapter_names(model), extra


def assert_same(after, before):
    (slots_a, aliases_a, adapters_a, opt_a), (slots_b, aliases_b, adapters_b, opt_b) = (
        after,
        before,
    )
    assert slots_a == slots_b and aliases_a == aliases_b and adapters_a == adapters_b
    if opt_b is None:
        return
    assert {k: v for k, v in opt_a.items() if k != "state"} == {
        k: v for k, v in opt_b.items() if k != "state"
    }
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for slot, entry in opt_b["state"].items():
        for name, value in entry.items():
            np.testing.assert_array_equal(opt_a["state"][slot][name], value)


def poison(array: np.ndarray, bad: float) -> np.ndarray:
    out = array.copy()
    for spot in SPOTS:
        out[spot] = bad
    return out


def edit_safetensors(path, name: str, edit) -> None:
    """Rewrite the safetensors file at ``path`` with tensor ``name`` replaced by
    ``edit(array)``, keeping its metadata (a file any writer could have produced)."""
    with safe_open(os.fspath(path), "np") as f:
        metadata = f.metadata()
    tensors = safetensors.numpy.load_file(os.fspath(path))
    tensors[name] = edit(tensors[name])
    safetensors.numpy.save_file(tensors, os.fspath(path), metadata=metadata)


def refusal(load, target_state, file, tensor, count: int, *fragments: str) -> str:
    """``load()`` raises a ``TiegradError`` naming ``file``, ``tensor`` and ``count``
    non-finite values and offering the opt-in; ``target_state()`` is as before."""
    before = target_state()
    with pytest.raises(TiegradError) as info:
        load()
    message = str(info.value)
    assert isinstance(info.value, CheckpointError)
    expected = f"{file}: tensor {tensor!r}"
    assert message.startswith(expected), message
    assert f"holds {count} non-finite values (NaN or Inf)" in message, message
    assert "allow_nonfinite=True" in message and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    assert_same(target_state(), before)
    return message


# -- transformers GPT-2 folders ------------------------------------------------------------------
def _transformers():
    pytest.importorskip("torch")
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """A tiny random GPT-2 saved by transformers: the head tied to the embedding."""
    transformers = _transformers()
    import torch

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("gpt2")
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, n_positions=32, vocab_size=50,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def copied(folder, tmp_path):
    out = tmp_path / folder.name
    out.mkdir()
    for entry in folder.iterdir():
        (out / entry.name).write_bytes(entry.read_bytes())
    return out


@pytest.mark.parametrize("bad", BAD)
def test_non_finite_weights_in_a_transformers_folder_are_refused(gpt2_folder, tmp_path, bad):
    folder = copied(gpt2_folder, tmp_path)
    weights = folder / "model.safetensors"
    edit_safetensors(weights, C_ATTN, lambda a: poison(a, BAD[bad]))
    with pytest.raises(CheckpointError, match="holds 3 non-finite values"):
        GPT2.from_pretrained(folder)
    model = GPT2.from_pretrained(gpt2_folder)
    model.lm_head.weight.requires_grad = False  # a frozen use, kept frozen
    refusal(lambda: model.load_pretrained(folder), lambda: state(model), weights, C_ATTN, 3)
    loaded = GPT2.from_pretrained(folder, allow_nonfinite=True)
    value = loaded.get_parameter(C_ATTN).value
    assert all(np.array_equal(value[s], BAD[bad], equal_nan=True) for s in SPOTS)
    assert np.isfinite(value).sum() == value.size - 3
    model.load_pretrained(folder, allow_nonfinite=True)
    assert np.array_equal(model.get_parameter(C_ATTN).value, value, equal_nan=True)


def test_float64_weights_beyond_float32_count_as_non_finite(gpt2_folder, tmp_path):
    folder = copied(gpt2_folder, tmp_path)
    weights = folder / "model.safetensors"
    edit_safetensors(weights, C_ATTN, lambda a: a.astype(np.float64))
    GPT2.from_pretrained(folder)  # float64 within float32's range: cast, loaded
    edit_safetensors(weights, C_ATTN, lambda a: poison(a, 1e300))
    model = GPT2.from_pretrained(gpt2_folder)
    message = refusal(
        lambda: model.load_pretrained(folder),
        lambda: state(model),
        weights,
        C_ATTN,
        3,
        "3 of them finite float64 values beyond float32's range",
    )
    assert "NaN or Inf" in message
    loaded = GPT2.from_pretrained(folder, allow_nonfinite=True)
    assert np.isposinf(loaded.get_parameter(C_ATTN).value[SPOTS[0]])


def test_a_tied_head_stored_beside_its_embedding_loads_with_the_same_nans(gpt2_folder, tmp_path):
    # A file holding both tied tensors ties them when their values are equal; with the
    # opt-in, NaN at the same places in both is equal.
    folder = copied(gpt2_folder, tmp_path)
    weights = folder / "model.safetensors"
    wte = "transformer.wte.weight"
    tensors = safetensors.numpy.load_file(os.fspath(weights))
    tensors[wte] = poison(tensors[wte], np.nan)
    tensors["lm_head.weight"] = tensors[wte].copy()
    safetensors.numpy.save_file(tensors, os.fspath(weights), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="holds 3 non-finite values"):
        GPT2.from_pretrained(folder)
    model = GPT2.from_pretrained(folder, allow_nonfinite=True)
    assert model.aliases() == {wte: ["lm_head.weight"]}
    assert np.isnan(model.get_parameter("lm_head.weight").value).sum() == 3


def test_train_init_on_a_non_finite_folder_exits_2_with_one_line(
    gpt2_folder, tmp_path, monkeypatch, capsys
):
    folder = copied(gpt2_folder, tmp_path)  # weights are read before the tokenizer
    edit_safetensors(folder / "model.safetensors", C_ATTN, lambda a: poison(a, np.nan))
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n" * 20)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--init", folder.name, "--run", "run", "--text", "text.txt"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"tiegrad: error: {folder.name}{os.sep}model.safetensors: tensor")
    assert f"tensor {C_ATTN!r} holds 3 non-finite values" in err[0]
    assert not (tmp_path / "run").exists()


# -- PEFT adapters -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def peft_adapter(gpt2_folder, tmp_path_factory):
    """A LoRA adapter of the GPT-2's c_attn saved by PEFT, its factors random."""
    transformers = _transformers()
    peft = pytest.importorskip("peft")
    import torch

    base = transformers.GPT2LMHeadModel.from_pretrained(gpt2_folder)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fan_in_fan_out notice
        pm = peft.get_peft_model(base, config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    folder = tmp_path_factory.mktemp("adapter")
    pm.save_pretrained(folder)
    return folder


LORA_B = "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"


@pytest.mark.parametrize("bad", BAD)
def test_non_finite_factors_in_a_peft_adapter_are_refused(gpt2_folder, peft_adapter, tmp_path, bad):
    from tiegrad.interop.peft import load_adapter

    folder = copied(peft_adapter, tmp_path)
    weights = folder / "adapter_model.safetensors"
    edit_safetensors(weights, LORA_B, lambda b: poison(b, BAD[bad]))
    model = GPT2.from_pretrained(gpt2_folder)
    add_lora(model, "c_fc", rank=2, name="first")
    optimizer = AdamW(model.parameters(), lr=0.01)

    refusal(
        lambda: load_adapter(model, folder, name="second"),
        lambda: state(model, optimizer),
        weights,
        LORA_B,
        3,
    )
    assert adapter_names(model) == ["first"]
    assert load_adapter(model, folder, name="second", allow_nonfinite=True) == [C_ATTN]
    assert sorted(adapter_names(model)) == ["first", "second"]
    b = model.get_parameter("transformer.h.0.attn.c_attn.lora.second.B").value
    assert np.isfinite(b).sum() == b.size - 3


def test_float64_factors_beyond_float32_are_refused(gpt2_folder, peft_adapter, tmp_path):
    from tiegrad.interop.peft import load_adapter

    folder = copied(peft_adapter, tmp_path)
    weights = folder / "adapter_model.safetensors"
    edit_safetensors(weights, LORA_B, lambda b: poison(b.astype(np.float64), -1e40))
    model = GPT2.from_pretrained(gpt2_folder)
    refusal(
        lambda: load_adapter(model, folder),
        lambda: state(model),
        weights,
        LORA_B,
        3,
        "3 of them finite float64 values beyond float32's range",
    )
    load_adapter(model, folder, allow_nonfinite=True)


# -- tiegrad checkpoints -------------------------------------------------------------------------
def trained(seed: int):
    """A tiny tied language model, its AdamW stepped once with its own gradients; the
    head's embedding use frozen at slot 0's storage (a tie and a frozen flag to keep)."""
    model = TiedLM(12, d_model=8, n_layers=1, n_heads=2, max_seq_len=4, seed=seed)
    optimizer = AdamW(model.parameters(), lr=1e-2)
    session = tiegrad.EagerSession(seed=seed)
    x = np.arange(8).reshape(2, 4) % 12
    optimizer.step(session.backward(model.loss(session, x, (x + seed + 1) % 12)))
    return model, optimizer


EMBED = "param/embed.weight"


@pytest.fixture
def checkpoint(tmp_path):
    model, optimizer = trained(seed=0)
    path = tmp_path / "ckpt.safetensors"
    tiegrad.save(path, model, optimizer=optimizer)
    return path


@pytest.mark.parametrize("bad", BAD)
def test_non_finite_parameters_in_a_checkpoint_are_refused(checkpoint, bad):
    tensors, doc = read_doc(checkpoint)
    tensors[EMBED] = poison(tensors[EMBED], BAD[bad])
    write_doc(checkpoint, tensors, doc)  # checksums of the edited tensors: well-formed
    model, optimizer = trained(seed=1)
    refusal(
        lambda: tiegrad.load(checkpoint, model, optimizer=optimizer),
        lambda: state(model, optimizer),
        f"checkpoint {checkpoint}",
        EMBED,
        3,
        "(slot 'embed.weight')",
    )
    tiegrad.load(checkpoint, model, optimizer=optimizer, allow_nonfinite=True)
    value = model.get_parameter("embed.weight").value
    assert np.isfinite(value).sum() == value.size - 3
    assert (
        model.get_parameter("lm_head.weight").storage is model.get_parameter("embed.weight").storage
    )  # C9


def test_non_finite_optimizer_state_is_refused_even_with_the_opt_in(checkpoint):
    # A step never stores a NaN moment (it refuses or skips non-finite gradients), so the
    # optimizer refuses such state whatever allow_nonfinite says; see state_values.
    tensors, doc = read_doc(checkpoint)
    key = doc["optimizer"]["state"]["0"]["tensors"]["exp_avg"]
    tensors[key] = poison(tensors[key], np.nan)
    write_doc(checkpoint, tensors, doc)
    model, optimizer = trained(seed=1)
    before = state(model, optimizer)
    for allow in (False, True):
        with pytest.raises(CheckpointError, match=r"state 'exp_avg' of slot 0: 3 of \d+ values"):
            tiegrad.load(checkpoint, model, optimizer=optimizer, allow_nonfinite=allow)
        assert_same(state(model, optimizer), before)


def data_offset(path, tensor: str) -> int:
    """The file offset of the first byte of ``tensor``'s data."""
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    return 8 + n + json.loads(blob[8 : 8 + n])[tensor]["data_offsets"][0]


@pytest.mark.parametrize("tensor", [EMBED, "optim/0/exp_avg_sq"])
def test_a_flipped_byte_in_tensor_data_is_refused_naming_the_tensor(checkpoint, capsys, tensor):
    blob = bytearray(checkpoint.read_bytes())
    blob[data_offset(checkpoint, tensor) + 5] ^= 0x10  # one bit of one element
    checkpoint.write_bytes(bytes(blob))
    model, optimizer = trained(seed=1)
    before = state(model, optimizer)
    with pytest.raises(CheckpointError) as info:
        tiegrad.load(checkpoint, model, optimizer=optimizer)
    message = str(info.value)
    assert message.startswith(f"checkpoint {checkpoint}: tensor {tensor!r} is damaged"), message
    assert "CRC-32" in message
    assert_same(state(model, optimizer), before)
    with pytest.raises(CheckpointError, match=f"tensor {tensor!r} is damaged"):
        tiegrad.load(checkpoint, model, strict=False)  # whatever the load reads
    with pytest.raises(CheckpointError, match=f"tensor {tensor!r} is damaged"):
        tiegrad.inspect(checkpoint)
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", str(checkpoint)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert f"tensor {tensor!r} is damaged" in err[0]


def test_every_damaged_tensor_is_counted_in_a_bounded_message(tmp_path):
    params = [tiegrad.Param(np.full(4, i, np.float32), name=f"w{i}") for i in range(6)]
    path = tmp_path / "six.safetensors"
    tiegrad.save(path, tiegrad.ParamList(params))
    blob = bytearray(path.read_bytes())
    for i in range(6):
        blob[data_offset(path, f"param/w{i}")] ^= 1
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError) as info:
        tiegrad.load(path, tiegrad.ParamList(params))
    message = str(info.value)
    assert "tensor 'param/w0' is damaged" in message
    assert "damaged too: 'param/w1', 'param/w2', 'param/w3' and 2 more" in message


def test_the_checksums_are_crc32_of_each_tensors_bytes(checkpoint):
    tensors, doc = read_doc(checkpoint)
    assert doc["format_version"] == tiegrad.checkpoint.FORMAT_VERSION == 3
    assert doc["checksums"]["algorithm"] == "crc32"
    assert doc["checksums"]["tensors"] == {k: zlib.crc32(v.tobytes()) for k, v in tensors.items()}
    assert "checksums: CRC-32 of each of" in tiegrad.inspect(checkpoint)


class BigEndianState:
    """An optimizer whose state_dict holds a big-endian tensor (what save may be given)."""

    kind = "SGD"

    def state_dict(self):
        momentum = np.arange(6, dtype=">f4").reshape(2, 3)
        return {"kind": self.kind, "state": {0: {"momentum_buffer": momentum}}}


def test_a_checksum_covers_the_bytes_as_stored_whatever_the_byte_order(tmp_path):
    w = tiegrad.Param(np.ones((2, 3), np.float32), name="w")
    path = tmp_path / "be.safetensors"
    tiegrad.save(path, tiegrad.ParamList([w]), optimizer=BigEndianState())
    _, doc = read_doc(path)
    little = np.arange(6, dtype="<f4").tobytes()  # safetensors stores little-endian
    assert doc["checksums"]["tensors"]["optim/0/momentum_buffer"] == zlib.crc32(little)
    tiegrad.load(path, tiegrad.ParamList([w]))  # every tensor verified, none refused


def legacy(path) -> None:
    """Rewrite the checkpoint at ``path`` as tiegrad wrote it before checksums: format
    version 1, no ``checksums`` key (nor the later ``rows``)."""
    tensors, doc = read_doc(path)
    del doc["checksums"], doc["rows"]
    doc["format_version"] = 1
    write_doc(path, tensors, doc)


def test_a_checkpoint_without_checksums_loads_with_a_warning_naming_it(checkpoint):
    legacy(checkpoint)
    model, optimizer = trained(seed=1)
    with pytest.warns(UserWarning, match="without tensor checksums") as caught:
        tiegrad.load(checkpoint, model, optimizer=optimizer)
    assert len(caught) == 1 and str(checkpoint) in str(caught[0].message)
    assert caught[0].filename == __file__  # it points at the caller's load
    source, _ = trained(seed=0)
    for (path, p), (_, q) in zip(model.named_slots(), source.named_slots()):
        assert np.array_equal(p.value, q.value), path
    with pytest.warns(UserWarning, match="without tensor checksums"):
        assert "checksums: none (written before" in tiegrad.inspect(checkpoint)


def test_a_current_checkpoint_stripped_of_its_checksums_is_refused(checkpoint):
    tensors, doc = read_doc(checkpoint)
    del doc["checksums"]
    write_doc(checkpoint, tensors, doc)
    model, optimizer = trained(seed=1)
    before = state(model, optimizer)
    with pytest.raises(CheckpointError, match="expected .*'checksums'.* \\(format version 3\\)"):
        tiegrad.load(checkpoint, model, optimizer=optimizer)
    assert_same(state(model, optimizer), before)


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda c: c["tensors"].pop(EMBED), f"no checksum for {EMBED!r}"),
        (lambda c: c["tensors"].update({"param/x": 1}), "not in the file: 'param/x'"),
        (lambda c: c["tensors"].update({EMBED: -1}), "is -1, not a CRC-32"),
        (lambda c: c["tensors"].update({EMBED: "0x1"}), "is '0x1', not a CRC-32"),
        (lambda c: c.update(algorithm="sha256"), "checksum algorithm 'sha256'"),
        (lambda c: c.pop("tensors"), "checksums must be"),
    ],
)
def test_a_malformed_checksum_table_is_refused(checkpoint, edit, fragment):
    tensors, doc = read_doc(checkpoint)
    edit(doc["checksums"])
    safetensors.numpy.save_file(
        tensors, os.fspath(checkpoint), metadata={"tiegrad": json.dumps(doc)}
    )
    model, optimizer = trained(seed=1)
    before = state(model, optimizer)
    with pytest.raises(CheckpointError, match=f"checkpoint {checkpoint}: .*") as info:
        tiegrad.load(checkpoint, model, optimizer=optimizer)
    assert fragment in str(info.value)
    assert_same(state(model, optimizer), before)
