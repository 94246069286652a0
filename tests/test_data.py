"""tiegrad.data: vocabularies, text windows, array batching and the default corpus."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiegrad import ConfigError, DTypeError, ShapeError
from tiegrad.data import (
    ArrayDataset,
    BatchSource,
    DataLoader,
    HFTokenizer,
    TextDataset,
    Vocab,
    read_text,
    stdlib_corpus,
)

TEXT = "the quick brown fox jumps over the lazy dog. " * 20


# -- Vocab ----------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.text(min_size=1, max_size=60))
def test_char_vocab_round_trips_any_text(text):
    v = Vocab.build(text, "char")
    ids = v.encode(text)
    assert ids.dtype == np.int64 and ids.shape == (len(text),)
    assert v.decode(ids) == text
    assert v.size == len(set(text))


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=60))
def test_byte_vocab_round_trips_any_text(text):
    v = Vocab("byte")
    ids = v.encode(text)
    assert v.size == 256 and len(ids) == len(text.encode("utf-8"))
    assert v.decode(ids) == text


def test_vocab_is_json_and_rebuilds_the_same_map():
    v = Vocab.build("hello world", "char")
    data = json.loads(json.dumps(v.to_dict()))
    w = Vocab.from_dict(data)
    assert w == v
    assert np.array_equal(w.encode("world"), v.encode("world"))
    assert Vocab.from_dict(Vocab("byte").to_dict()) == Vocab("byte")


def test_vocab_errors_name_the_problem():
    v = Vocab.build("abc", "char")
    with pytest.raises(ConfigError, match="'z'"):
        v.encode("abz")
    with pytest.raises(ConfigError, match=r"\[0, 3\)"):
        v.decode([0, 5])
    with pytest.raises(ConfigError, match="unknown kind"):
        Vocab("word")
    with pytest.raises(ConfigError, match="distinct"):
        Vocab("char", "aa")
    with pytest.raises(ConfigError):
        Vocab.from_dict({"chars": "ab"})


def test_byte_vocab_names_a_character_without_utf8_bytes():
    with pytest.raises(ConfigError, match=r"character '\\ud800' at position 2"):
        Vocab("byte").encode("ab\ud800")


@pytest.mark.parametrize("kind", ["char", "byte"])
def test_decode_refuses_non_integer_ids_instead_of_truncating(kind):
    v = Vocab.build("abc", kind)
    for bad in ([1.7], np.array([1.0]), [True], ["1"]):
        with pytest.raises(DTypeError, match="vocab: token ids must be integers"):
            v.decode(bad)
    assert v.decode(np.array([1], np.uint8)) == ("b" if kind == "char" else "\x01")
    assert v.decode([]) == ""


def test_hf_tokenizer_decode_refuses_non_integer_ids():
    tokenizers = pytest.importorskip("tokenizers")
    word_level = tokenizers.models.WordLevel({"a": 0, "b": 1}, unk_token="a")
    tok = HFTokenizer({"tokenizer.json": tokenizers.Tokenizer(word_level).to_str()})
    assert tok.decode(np.array([1], np.int32)) == "b"
    with pytest.raises(DTypeError, match="tokenizer: token ids must be integers, got float64"):
        tok.decode([1.7])


# -- TextDataset ----------------------------------------------------------------------
def test_split_is_contiguous_and_covers_the_text():
    d = TextDataset(TEXT, block_size=8, val_fraction=0.25)
    ids = d.encode(TEXT)
    assert len(d.val) == int(len(ids) * 0.25)
    assert np.array_equal(np.concatenate([d.train, d.val]), ids)
    assert d.decode(d.train) + d.decode(d.val) == TEXT


def test_windows_are_shifted_targets_from_the_split():
    d = TextDataset(TEXT, block_size=8)
    x, y = d.sample("train", 5, np.random.default_rng(1))
    assert x.shape == y.shape == (5, 8) and x.dtype == np.int64
    assert np.array_equal(x[:, 1:], y[:, :-1])
    train_text = d.decode(d.train)
    for row_x, row_y in zip(x, y):
        assert (d.decode(row_x) + d.decode(row_y[-1:])) in train_text


def test_same_generator_state_gives_the_same_batches():
    d = TextDataset(TEXT, block_size=8)
    ra, rb = np.random.default_rng(3), np.random.default_rng(3)
    a = [d.sample("train", 4, ra) for _ in range(3)]
    b = [d.sample("train", 4, rb) for _ in range(3)]
    for (xa, ya), (xb, yb) in zip(a, b):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    xc, _ = d.sample("train", 4, np.random.default_rng(4))
    assert not np.array_equal(a[0][0], xc)


def test_eval_batches_are_fixed_and_inside_the_val_split():
    d = TextDataset(TEXT, block_size=8, val_fraction=0.3)
    first = d.eval_batches("val", 4, 3)
    again = d.eval_batches("val", 4, 3)
    assert len(first) == 3
    for (xa, ya), (xb, yb) in zip(first, again):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    val_text = d.decode(d.val)
    assert all(d.decode(row) in val_text for x, _ in first for row in x)


def test_window_loader_is_a_batch_source_with_token_counts():
    d = TextDataset(TEXT, block_size=8)
    loader = d.loader("train", 4)
    assert isinstance(loader, BatchSource)
    assert len(loader) == len(d.train) // 32
    batches = list(loader.epoch(np.random.default_rng(0)))
    assert len(batches) == len(loader)
    assert loader.count(batches[0]) == 32


def test_byte_vocab_dataset_and_a_stored_vocab():
    d = TextDataset(TEXT.encode(), block_size=8, vocab="byte")
    assert d.vocab_size == 256 and d.decode(d.train[:3]) == TEXT[:3]
    stored = Vocab.from_dict(TextDataset(TEXT, 8).vocab.to_dict())
    e = TextDataset(TEXT, 8, vocab=stored)
    assert e.vocab is stored


def test_too_short_text_and_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="block_size"):
        TextDataset("abcdefgh" * 2, block_size=8)
    with pytest.raises(ConfigError, match="val_fraction"):
        TextDataset(TEXT, 8, val_fraction=1.5)
    with pytest.raises(ConfigError, match="block_size"):
        TextDataset(TEXT, 0)
    with pytest.raises(ConfigError, match="empty"):
        TextDataset("", 8)
    with pytest.raises(ConfigError, match="split"):
        TextDataset(TEXT, 8).sample("test", 2, np.random.default_rng(0))


def test_val_fraction_is_any_real_number_in_range():
    d = TextDataset(TEXT, 8, val_fraction=np.float32(0.25))
    e = TextDataset(TEXT, 8, val_fraction=0.25)
    assert (len(d.train), len(d.val)) == (len(e.train), len(e.val))
    for bad in (True, np.bool_(True), "0.25", None):
        with pytest.raises(ConfigError, match="val_fraction must be a real number"):
            TextDataset(TEXT, 8, val_fraction=bad)
    with pytest.raises(ConfigError, match=r"val_fraction must lie in \(0, 1\), got 1"):
        TextDataset(TEXT, 8, val_fraction=np.int64(1))


def test_read_text_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="missing.txt.*does not exist"):
        read_text(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty.txt.*empty"):
        read_text(empty)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_text(latin)
    assert read_text(latin, "byte") == b"caf\xe9 au lait"
    with pytest.raises(ConfigError, match="is not a file"):
        TextDataset.from_file(tmp_path, 8)


# -- ArrayDataset / DataLoader ---------------------------------------------------------
def test_loader_covers_every_sample_once_per_epoch():
    x = np.arange(10 * 3).reshape(10, 3)
    y = np.arange(10)
    loader = DataLoader(ArrayDataset(x, y), batch_size=4)
    assert len(loader) == 3
    batches = list(loader.epoch(np.random.default_rng(0)))
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    seen = np.concatenate([b[1] for b in batches])
    assert sorted(seen) == list(range(10)) and not np.array_equal(seen, np.arange(10))
    for bx, by in batches:
        assert np.array_equal(bx, x[by])


def test_loader_order_follows_the_generator_and_drop_last():
    ds = ArrayDataset(np.arange(10))
    a = [b[0] for b in DataLoader(ds, 3).epoch(np.random.default_rng(5))]
    b = [b[0] for b in DataLoader(ds, 3).epoch(np.random.default_rng(5))]
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    plain = [b[0] for b in DataLoader(ds, 3, shuffle=False, drop_last=True)]
    assert len(plain) == 3 and np.array_equal(np.concatenate(plain), np.arange(9))


def test_array_dataset_checks_lengths_and_split():
    with pytest.raises(ShapeError, match="array 1 has 3 samples, expected 4"):
        ArrayDataset(np.zeros((4, 2)), np.zeros(3))
    with pytest.raises(ConfigError, match="batch_size"):
        DataLoader(ArrayDataset(np.zeros(4)), 0)
    train, test = ArrayDataset(np.arange(20)).split(0.25, np.random.default_rng(0))
    assert len(train) == 15 and len(test) == 5
    assert sorted(np.concatenate([train.arrays[0], test.arrays[0]])) == list(range(20))


# -- the default corpus --------------------------------------------------------------
def test_stdlib_corpus_is_deterministic_ascii_and_capped():
    a = stdlib_corpus(max_chars=200_000)
    b = stdlib_corpus(max_chars=200_000)
    assert a == b
    assert 10_000 < len(a) <= 200_000
    assert a.isascii()
    assert "def " in a and "import " in a


def test_stdlib_corpus_on_a_folder_without_sources(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "b.py").write_text("b = 2\n")
    (tmp_path / "a.py").write_text("a = 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("skipped = True\n")
    (tmp_path / "u.py").write_text("u = '\u00e9'\n", encoding="utf-8")
    assert stdlib_corpus(root=tmp_path) == "a = 1\nb = 2\n"
    assert stdlib_corpus(max_chars=3, root=tmp_path) == "a = 1\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="--text FILE"):
        stdlib_corpus(root=empty)
