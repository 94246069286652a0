"""Checkpoints keep ties (C9): the file format, round trips, atomic writes, damaged files.

Every bad input raises ``CheckpointError`` naming the file (and the slot where there is
one), and the target is bit-identical afterwards (C6).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import tiegrad
from tiegrad import CheckpointError, Param, ParamList

F32 = np.float32


def mixed_list(seed: int = 0) -> ParamList:
    """[frozen p, p, q, p]: a frozen alias, a tie across three slots and a lone storage."""
    g = np.random.default_rng(seed)
    p = Param(g.standard_normal((5, 3)).astype(F32), name="embed.weight")
    q = Param(g.standard_normal(3).astype(F32), name="block.bias")
    return ParamList(
        [p.alias(requires_grad=False, name="frozen.embed"), p, q, p.alias(name="head.weight")]
    )


def tied_list(seed: int = 0, untie_last: bool = False) -> ParamList:
    """[p, q, p] named a, b, c; with ``untie_last`` the last slot shares q: [p, q, q]."""
    g = np.random.default_rng(seed)
    p = Param(g.standard_normal((2, 2)).astype(F32), name="a")
    q = Param(g.standard_normal((2, 2)).astype(F32), name="b")
    return ParamList([p, q, (q if untie_last else p).alias(name="c")])


def snapshot(plist: ParamList) -> list[tuple]:
    """Everything load may change: storage identity per slot, value bytes, dtype, flags."""
    return [
        (id(p.storage), p.value.tobytes(), p.value.dtype.name, p.shape, p.requires_grad)
        for p in plist
    ]


def layout(plist: ParamList) -> list[int]:
    """The first slot holding each slot's storage (C1)."""
    first: dict[int, int] = {}
    return [first.setdefault(id(p.storage), i) for i, p in enumerate(plist)]


def read_doc(path) -> tuple[dict, dict]:
    """The tensors and the parsed schema of a checkpoint, read through safetensors."""
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
    return safetensors.numpy.load_file(str(path)), json.loads(meta["tiegrad"])


def write_doc(path, tensors: dict, doc: dict) -> None:
    """Write ``tensors`` with the schema ``doc``; a ``doc`` with checksums gets those of
    ``tensors`` (an edited file that is well-formed, so that the check named fires)."""
    if "checksums" in doc:
        crcs = {k: zlib.crc32(np.ascontiguousarray(v).tobytes()) for k, v in tensors.items()}
        doc = {**doc, "checksums": {**doc["checksums"], "tensors": crcs}}
    safetensors.numpy.save_file(tensors, str(path), metadata={"tiegrad": json.dumps(doc)})


def split_header(blob: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def join_header(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def expect_rejected(path, target: ParamList, *fragments: str, **kwargs) -> CheckpointError:
    """Load must raise CheckpointError naming the file and ``fragments``; target unchanged."""
    before = snapshot(target)
    with pytest.raises(CheckpointError) as info:
        tiegrad.load(path, target, **kwargs)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    assert snapshot(target) == before
    return info.value


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "mixed.safetensors"
    tiegrad.save(path, mixed_list(), extra={"note": "hello", "epoch": 3})
    return path


# -- round trips --------------------------------------------------------------------------------


def test_round_trip_restores_values_ties_and_mask(tmp_path):  # C9
    source = mixed_list(seed=1)
    rng = np.random.default_rng(7)
    rng.random(3)
    path = tmp_path / "ckpt.safetensors"
    size = tiegrad.save(path, source, extra={"epoch": 2}, rng=rng)
    assert size == os.path.getsize(path)
    target = mixed_list(seed=2)
    fresh = np.random.default_rng(0)
    result = tiegrad.load(path, target, rng=fresh)
    assert [p.value.tobytes() for p in target] == [p.value.tobytes() for p in source]
    assert layout(target) == [0, 0, 2, 0]
    assert target[0].storage is target[1].storage is target[3].storage
    assert [p.requires_grad for p in target] == [False, True, True, True]
    assert result.extra == {"epoch": 2} and result.step is None
    assert result.missing == () and result.unexpected == ()
    assert fresh.bit_generator.state == rng.bit_generator.state
    assert fresh.random() == rng.random()


def test_loading_twice_writes_each_storage_once_and_is_idempotent(saved):
    target = mixed_list(seed=5)
    tiegrad.load(saved, target)
    first = snapshot(target)
    tiegrad.load(saved, target)
    assert snapshot(target) == first


def test_unnamed_and_repeated_handles_get_unique_paths(tmp_path):
    p = Param(np.ones(2, F32))
    q = Param(np.zeros(2, F32), name="q")
    path = tmp_path / "anon.safetensors"
    tiegrad.save(path, ParamList([p, q, p]))
    _, doc = read_doc(path)
    assert [s["path"] for s in doc["slots"]] == ["slot0", "q", "slot2"]
    named = Param(np.ones(2, F32), name="w")
    tiegrad.save(tmp_path / "named.safetensors", ParamList([named, q, named]))
    _, doc = read_doc(tmp_path / "named.safetensors")
    assert [s["path"] for s in doc["slots"]] == ["w", "q", "w#2"]
    target_p = Param(np.full(2, 9, F32))
    target = ParamList([target_p, Param(np.full(2, 9, F32), name="q"), target_p])
    tiegrad.load(path, target)
    assert target[0].value.tolist() == [1, 1] and target[1].value.tolist() == [0, 0]


def test_save_reads_values_synced(tmp_path):  # C7
    torch = pytest.importorskip("torch")
    p = Param(np.zeros(3, F32), name="w")
    p.to("torch:cpu")
    p.set_device_value(torch.tensor([1.0, 2.0, 3.0]))
    assert not p.storage.host_current
    path = tmp_path / "m.safetensors"
    tiegrad.save(path, ParamList([p]))
    assert safetensors.numpy.load_file(str(path))["param/w"].tolist() == [1, 2, 3]


def test_load_is_a_host_write_that_releases_the_mirror(saved):  # C7
    pytest.importorskip("torch")
    target = mixed_list(seed=9)
    target.to("torch:cpu")
    tiegrad.load(saved, target)
    assert all(p.storage.mirror is None and p.storage.host_current for p in target)
    assert target[2].value.tobytes() == mixed_list()[2].value.tobytes()


def test_model_with_param_list_is_accepted(tmp_path):
    class Model:
        def __init__(self, plist):
            self.plist = plist

        def param_list(self):
            return self.plist

    path = tmp_path / "model.safetensors"
    tiegrad.save(path, Model(tied_list(seed=1)))
    target = tied_list(seed=2)
    tiegrad.load(path, Model(target))
    assert [p.value.tobytes() for p in target] == [p.value.tobytes() for p in tied_list(seed=1)]
    with pytest.raises(CheckpointError, match="expected a ParamList"):
        tiegrad.load(path, object())


# -- the file stays plain safetensors -----------------------------------------------------------


def test_file_is_plain_safetensors_with_each_storage_once(saved):
    tensors, doc = read_doc(saved)
    assert sorted(tensors) == ["param/block.bias", "param/frozen.embed"]
    assert tensors["param/frozen.embed"].tobytes() == mixed_list()[1].value.tobytes()
    assert doc["format_version"] == tiegrad.checkpoint.FORMAT_VERSION
    assert [(s["canonical"], s["storage"]) for s in doc["slots"]] == [
        (None, 0),
        (1, 0),
        (2, 2),
        (1, 0),
    ]
    assert doc["extra"] == {"note": "hello", "epoch": 3}


def test_tied_model_file_is_unique_storage_bytes_plus_five_percent(tmp_path):
    g = np.random.default_rng(0)
    embed = Param(g.standard_normal((512, 64)).astype(F32), name="embed.weight")
    layers = [Param(g.standard_normal((64, 64)).astype(F32), name=f"l{i}.w") for i in range(4)]
    plist = ParamList([embed, *layers, embed.alias(name="head.weight")])
    path = tmp_path / "tied.safetensors"
    tiegrad.save(path, plist)
    unique = embed.value.nbytes + sum(p.value.nbytes for p in layers)
    size = os.path.getsize(path)
    assert unique < size <= 1.05 * unique
    assert size < unique + embed.value.nbytes  # the tied weight is not stored twice


def test_inspect_lists_slots_ties_frozen_flags_and_bytes(saved):
    text = tiegrad.inspect(saved)
    assert str(saved) in text and f"{os.path.getsize(saved):,} bytes" in text
    assert "4 slots, 2 storages, 2 tied slots, 1 frozen slot" in text
    assert "tie: frozen.embed = embed.weight = head.weight" in text
    assert "= slot 0 (tied)" in text and "frozen" in text and "5x3" in text
    assert "optimizer: none" in text and '"note": "hello"' in text


# -- atomic writes ------------------------------------------------------------------------------

_KILLED_WRITER = """
import sys
import numpy as np
import tiegrad
big = [tiegrad.Param(np.full((1024, 1024), i, np.float32), name=f"w{i}") for i in range(16)]
tiegrad.save(sys.argv[1], tiegrad.ParamList(big))
"""


def test_save_killed_mid_write_leaves_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    tiegrad.save(path, tied_list(seed=3))
    before = path.read_bytes()
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_KILLED_WRITER), str(path)])
    deadline = time.monotonic() + 60
    temps: list[str] = []
    try:
        while not temps and child.poll() is None and time.monotonic() < deadline:
            temps = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert temps, "the writer finished before it could be killed mid-write"
    assert child.returncode == -signal.SIGKILL
    assert path.read_bytes() == before
    target = tied_list(seed=4)
    tiegrad.load(path, target)
    assert snapshot(target)[0][1] == tied_list(seed=3)[0].value.tobytes()


def test_failed_write_deletes_temporary_file_and_keeps_old(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    tiegrad.save(path, tied_list(seed=3))
    before = path.read_bytes()

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(CheckpointError, match="No space left") as info:
        tiegrad.save(path, tied_list(seed=4))
    assert str(path) in str(info.value)
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]
    assert path.read_bytes() == before


def test_invalid_extra_raises_before_touching_the_file(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    with pytest.raises(CheckpointError, match="extra is not JSON-serializable"):
        tiegrad.save(path, tied_list(), extra={"array": np.ones(2)})
    assert os.listdir(tmp_path) == []


# -- damaged files ------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    expect_rejected(tmp_path / "nope.safetensors", tied_list(), "cannot read")


def test_truncated_file(saved):
    blob = saved.read_bytes()
    saved.write_bytes(blob[:-1])
    expect_rejected(saved, mixed_list(seed=9), "truncated")


def test_file_shorter_than_the_length_prefix(saved):
    saved.write_bytes(saved.read_bytes()[:5])
    expect_rejected(saved, mixed_list(seed=9), "too short")


def test_header_length_larger_than_file(saved):
    blob = saved.read_bytes()
    saved.write_bytes((len(blob)).to_bytes(8, "little") + blob[8:])
    expect_rejected(saved, mixed_list(seed=9), "header length", "larger than")


def test_flipped_header_bytes(saved):
    blob = bytearray(saved.read_bytes())
    blob[8] ^= 0xFF  # the header's opening brace
    saved.write_bytes(bytes(blob))
    expect_rejected(saved, mixed_list(seed=9), "not valid UTF-8 JSON")


def test_overlapping_tensor_offsets(saved):
    header, data = split_header(saved.read_bytes())
    names = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"]
    )
    begin, end = header[names[1]]["data_offsets"]
    header[names[1]]["data_offsets"] = [0, end - begin]
    saved.write_bytes(join_header(header, data))
    expect_rejected(saved, mixed_list(seed=9), "overlaps")


def test_tensor_offsets_out_of_range(saved):
    header, data = split_header(saved.read_bytes())
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 4, end + 4]
    saved.write_bytes(join_header(header, data))
    expect_rejected(saved, mixed_list(seed=9), repr(name), "outside")


def test_trailing_bytes_after_the_tensors(saved):
    saved.write_bytes(saved.read_bytes() + b"\0\0\0\0")
    expect_rejected(saved, mixed_list(seed=9), "trailing bytes")


def test_plain_safetensors_file_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "plain.safetensors"
    safetensors.numpy.save_file({"w": np.ones(2, F32)}, str(path))
    expect_rejected(path, tied_list(), "not a tiegrad checkpoint")


def test_missing_tensor(saved):
    tensors, doc = read_doc(saved)
    del tensors["param/block.bias"]
    write_doc(saved, tensors, doc)
    expect_rejected(saved, mixed_list(seed=9), "slot 2 ('block.bias')", "missing from the file")


def test_extra_tensor(saved):
    tensors, doc = read_doc(saved)
    tensors["param/stowaway"] = np.ones(3, F32)
    write_doc(saved, tensors, doc)
    expect_rejected(saved, mixed_list(seed=9), "not described by the schema", "param/stowaway")


def test_format_version_from_the_future(saved):
    tensors, doc = read_doc(saved)
    doc["format_version"] = tiegrad.checkpoint.FORMAT_VERSION + 1
    write_doc(saved, tensors, doc)
    expect_rejected(saved, mixed_list(seed=9), "newer than this tiegrad reads")


@pytest.mark.parametrize(
    "edits, fragments",
    [
        pytest.param(
            [(1, "canonical", 3)],
            ("slot 1 ('embed.weight')", "points forward"),
            id="canonical_slot_pointing_forward",
        ),
        pytest.param(
            [(1, "canonical", 0), (3, "canonical", 0)],
            ("slot 1 ('embed.weight')", "is a frozen slot"),
            id="canonical_slot_at_a_frozen_slot",
        ),
        pytest.param(
            [(0, "canonical", 0)],
            ("slot 0 ('frozen.embed')", "is frozen but"),
            id="frozen_slot_with_a_canonical_slot",
        ),
        pytest.param(
            [(0, "storage", 1)],
            ("slot 0 ('frozen.embed')", "storage slot 1"),
            id="storage_slot_pointing_forward",
        ),
        pytest.param(
            [(2, "storage", 0), (2, "tensor", "param/frozen.embed")],
            ("slot 2 ('block.bias')", "shares the storage"),
            id="tie_with_another_shape",
        ),
    ],
)
def test_schema_slot_edit_is_rejected(saved, edits, fragments):
    tensors, doc = read_doc(saved)
    for slot, key, value in edits:
        doc["slots"][slot][key] = value
    write_doc(saved, tensors, doc)
    expect_rejected(saved, mixed_list(seed=9), *fragments)


# -- mismatches with the target -----------------------------------------------------------------


def test_shape_mismatch(saved):
    target = mixed_list(seed=9)
    target = ParamList([*target[:2], Param(np.zeros(4, F32), name="block.bias"), target[3]])
    expect_rejected(saved, target, "'block.bias'", "shape mismatch", "(3,)", "(4,)")


def test_dtype_mismatch(saved):
    target = mixed_list(seed=9)
    target = ParamList([*target[:2], Param(np.zeros(3), name="block.bias"), target[3]])
    expect_rejected(saved, target, "'block.bias'", "dtype mismatch", "float32", "float64")


def test_alias_layout_mismatch_shows_both_layouts(tmp_path):
    path = tmp_path / "pqp.safetensors"
    tiegrad.save(path, tied_list(seed=1))
    err = expect_rejected(path, tied_list(seed=2, untie_last=True), "alias layout mismatch")
    lines = str(err).splitlines()
    assert "slot 2 ('c')" in lines[0]
    assert "file" in lines[1] and "model" in lines[1]
    row = next(line for line in lines if line.strip().startswith("2 "))
    assert "<-- differs" in row
    file_side, model_side = row.split("|")
    assert file_side.split()[-1] == "0" and model_side.split()[-3] == "1"


def test_trainability_mismatch(saved):
    target = mixed_list(seed=9)
    target = ParamList([target[0], target[1], target[2].alias(requires_grad=False), target[3]])
    expect_rejected(saved, target, "trainability mismatch at slot 2 ('block.bias')")


def test_missing_and_unexpected_slots_in_strict_mode(saved):
    target = mixed_list(seed=9)
    renamed = ParamList([*target[:3], target[3].alias(name="lm_head.weight")])
    expect_rejected(saved, renamed, "missing from the file ['lm_head.weight']", "'head.weight'")


def test_same_slots_in_another_order(saved):
    target = mixed_list(seed=9)
    expect_rejected(saved, ParamList([target[0], target[2], target[1], target[3]]), "another order")


def test_rng_requested_from_a_file_without_one(saved):
    gen = np.random.default_rng(3)
    state = gen.bit_generator.state
    expect_rejected(saved, mixed_list(seed=9), "holds no RNG state", rng=gen)
    assert gen.bit_generator.state == state


def test_rng_of_another_kind(tmp_path):
    path = tmp_path / "rng.safetensors"
    saved_gen = np.random.Generator(np.random.MT19937(1))
    tiegrad.save(path, tied_list(), rng=saved_gen)
    gen = np.random.default_rng(3)
    state = gen.bit_generator.state
    expect_rejected(path, tied_list(seed=2), "PCG64", rng=gen)
    assert gen.bit_generator.state == state
    same_kind = np.random.Generator(np.random.MT19937(5))
    tiegrad.load(path, tied_list(seed=2), rng=same_kind)
    assert same_kind.random() == saved_gen.random()


# -- strict=False -------------------------------------------------------------------------------


def test_a_name_that_is_not_utf8_text_is_refused_before_writing(tmp_path):  # C6
    path = tmp_path / "names.safetensors"
    with pytest.raises(CheckpointError, match=r"slot 1: path 'w\\ud800' is not UTF-8 text"):
        tiegrad.save(
            path, ParamList([Param(np.ones(2), name="a"), Param(np.ones(2), name="w\ud800")])
        )
    assert not path.exists() and not os.listdir(tmp_path)


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_a_tensor_rewritten_as_bfloat16_is_refused(tmp_path, with_optimizer):  # C6, C9
    from tiegrad.optim import Adam

    plist = ParamList([Param(np.array([1.1, 2.2, 3.3], np.float32), name="w")])
    opt = Adam(plist, lr=0.1)
    opt.step([np.ones(3, np.float32)])
    path = tmp_path / "bf16.safetensors"
    tiegrad.save(path, plist, optimizer=opt)
    header, data = split_header(path.read_bytes())
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    narrowed, out = {}, b""
    for key in sorted(tensors):  # every tensor's upper 16 bits, the schema left as it was
        begin, end = tensors[key]["data_offsets"]
        raw = (np.frombuffer(data[begin:end], np.uint32) >> 16).astype("<u2").tobytes()
        narrowed[key] = dict(
            tensors[key], dtype="BF16", data_offsets=[len(out), len(out) + len(raw)]
        )
        out += raw
    narrowed["__metadata__"] = header["__metadata__"]
    path.write_bytes(join_header(narrowed, out))
    target = ParamList([Param(np.zeros(3, np.float32), name="w")])
    kwargs = {"optimizer": Adam(target, lr=0.1)} if with_optimizer else {}
    expect_rejected(path, target, "is stored as BF16", **kwargs)


def test_non_strict_loads_matching_paths_and_reports_the_rest(saved):
    target = mixed_list(seed=9)
    extra_slot = Param(np.full(2, 7, F32), name="new.bias")
    partial = ParamList([target[1], target[3], extra_slot])  # embed.weight, head.weight, new.bias
    result = tiegrad.load(saved, partial, strict=False)
    assert result.missing == ("new.bias",)
    assert result.unexpected == ("frozen.embed", "block.bias")
    assert partial[0].value.tobytes() == mixed_list()[1].value.tobytes()
    assert extra_slot.value.tolist() == [7, 7]
    assert target[2].value.tobytes() == mixed_list(seed=9)[2].value.tobytes()


def test_non_strict_still_rejects_shape_and_tie_mismatches(tmp_path):
    path = tmp_path / "pqp.safetensors"
    tiegrad.save(path, tied_list(seed=1))
    expect_rejected(path, tied_list(seed=2, untie_last=True), "alias layout mismatch", strict=False)
    wrong = ParamList([Param(np.zeros(3, F32), name="a")])
    expect_rejected(path, wrong, "shape mismatch", strict=False)


# -- random damage ------------------------------------------------------------------------------

_VALID = {}


def valid_checkpoint() -> bytes:
    if "blob" not in _VALID:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "v.safetensors")
            tiegrad.save(path, mixed_list(seed=1), extra={"k": [1, 2.5, "x"]})
            with open(path, "rb") as f:
                _VALID["blob"] = f.read()
    return _VALID["blob"]


def header_end() -> int:
    blob = valid_checkpoint()
    return 8 + int.from_bytes(blob[:8], "little")


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_byte_mutations_load_consistently_or_raise_checkpoint_error(data):
    blob = bytearray(valid_checkpoint())
    positions = st.one_of(
        st.integers(0, header_end() - 1), st.integers(0, len(blob) - 1)
    )  # mostly the header, where damage matters most
    edits = data.draw(st.lists(st.tuples(positions, st.integers(1, 255)), min_size=1, max_size=4))
    for pos, mask in edits:
        blob[pos] ^= mask
    target = mixed_list(seed=2)
    before = snapshot(target)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.safetensors")
        with open(path, "wb") as f:
            f.write(bytes(blob))
        try:
            tiegrad.load(path, target)
        except CheckpointError as e:
            assert path in str(e)
            assert snapshot(target) == before
            return
        tensors, doc = read_doc(path)
    assert layout(target) == [0, 0, 2, 0]
    for p, slot in zip(target, doc["slots"]):
        assert p.value.tobytes() == tensors[slot["tensor"]].tobytes()
