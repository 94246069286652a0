"""tiegrad.data refuses bad input with a clear TiegradError and changes nothing (C6).

Vocabularies, Hugging Face tokenizers, text files, array datasets and loaders: every
argument of the wrong type or value is named in the error, never converted or passed
on to NumPy or ``tokenizers`` to fail there.
"""

import re

import numpy as np
import pytest

from tiegrad import ConfigError, DTypeError, HyperparameterError
from tiegrad.data import (
    ArrayDataset,
    DataLoader,
    HFTokenizer,
    TextDataset,
    Vocab,
    WindowLoader,
    read_text,
)

TEXT = "the quick brown fox jumps over the lazy dog. " * 20


def rng_state(rng: np.random.Generator) -> dict:
    return rng.bit_generator.state


# -- HFTokenizer ----------------------------------------------------------------------
def word_level(vocab: dict[str, int], unk: str | None = "[UNK]") -> HFTokenizer:
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel(vocab, unk_token=unk)
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return HFTokenizer({"tokenizer.json": tok.to_str()})


def test_hf_tokenizer_size_is_the_largest_id_plus_one_when_ids_have_gaps():
    h = word_level({"a": 0, "[UNK]": 1, "b": 5})
    ids = h.encode("a b")
    assert ids.tolist() == [0, 5]
    assert h.size == len(h) == 6
    assert h.decode(ids) == "a b"
    data = TextDataset("a b " * 60, 4, vocab=h)
    assert data.vocab_size == 6 > data.train.max()


def test_hf_tokenizer_of_an_empty_vocabulary_has_size_zero():
    assert word_level({}).size == 0


@pytest.mark.parametrize("text", [None, b"a b", 5, ["a"]])
def test_hf_tokenizer_encode_needs_a_str(text):
    h = word_level({"a": 0, "[UNK]": 1})
    with pytest.raises(ConfigError, match=f"text must be a str, got {type(text).__name__}"):
        h.encode(text)


def test_hf_tokenizer_names_a_lone_surrogate_and_its_position():
    h = word_level({"a": 0, "[UNK]": 1})
    with pytest.raises(ConfigError, match=r"character '\\ud800' at position 2 has no UTF-8"):
        h.encode("a \ud800")


def test_hf_tokenizer_errors_of_tokenizers_become_config_errors():
    h = word_level({"a": 0, "b": 1}, unk=None)  # no unknown token: "c" cannot be encoded
    with pytest.raises(ConfigError, match=r"tokenizers cannot encode.*Missing \[UNK\]"):
        h.encode("a b c")
    with pytest.raises(ConfigError, match=r"Missing \[UNK\]"):
        TextDataset("a b c " * 50, 4, vocab=h)


def test_hf_tokenizer_save_creates_missing_folders_as_save_pretrained(tmp_path):
    h = word_level({"a": 0, "[UNK]": 1})
    target = tmp_path / "new" / "model"
    h.save(target)
    assert (target / "tokenizer.json").read_text(encoding="utf-8") == h.files["tokenizer.json"]
    assert HFTokenizer.from_directory(target).encode("a x").tolist() == [0, 1]


def test_hf_tokenizer_save_onto_a_file_names_the_path_and_keeps_the_file(tmp_path):
    h = word_level({"a": 0, "[UNK]": 1})
    blocker = tmp_path / "taken"
    blocker.write_text("keep me")
    with pytest.raises(ConfigError, match="cannot write into .*taken"):
        h.save(blocker)
    assert blocker.read_text() == "keep me"
    with pytest.raises(ConfigError, match="directory must be a str or os.PathLike, got NoneType"):
        h.save(None)
    with pytest.raises(ConfigError, match="directory must be a str or os.PathLike, got int"):
        HFTokenizer.from_directory(3)


# -- Vocab ----------------------------------------------------------------------------
@pytest.mark.parametrize("chars", [["a", "b", "c"], ["ab", "c"], 5, None, b"abc"])
def test_char_vocab_needs_a_str_of_characters(chars):
    with pytest.raises(ConfigError, match=f"chars must be a str, got {type(chars).__name__}"):
        Vocab("char", chars)


def test_a_str_char_vocab_reads_back_from_its_dict():
    v = Vocab("char", "abc")
    assert Vocab.from_dict(v.to_dict()) == v


@pytest.mark.parametrize("kind", ["char", "byte"])
@pytest.mark.parametrize("text", [b"the", 5, None])
def test_vocab_encode_needs_a_str(kind, text):
    v = Vocab.build(TEXT, kind)
    with pytest.raises(ConfigError, match=f"text must be a str, got {type(text).__name__}"):
        v.encode(text)


@pytest.mark.parametrize("text", [b"abc", None, 5])
def test_vocab_build_needs_a_str(text):
    with pytest.raises(
        ConfigError, match=f"Vocab.build: text must be a str, got {type(text).__name__}"
    ):
        Vocab.build(text)
    if isinstance(text, bytes):  # what read_text(path, "byte") gives
        assert Vocab.build(text, "byte").size == 256


# -- read_text and TextDataset ---------------------------------------------------------
def test_read_text_checks_kind_and_path(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abc\n")
    assert read_text(path, "byte") == b"abc\n" and read_text(str(path)) == "abc\n"
    for kind in ("bytes", None, "BYTE"):
        with pytest.raises(ConfigError, match=f"read_text: unknown kind {kind!r}"):
            read_text(path, kind)
    for bad in (None, 0):
        with pytest.raises(
            ConfigError, match=f"path must be a str or os.PathLike, got {type(bad).__name__}"
        ):
            read_text(bad)


def test_text_dataset_from_file_with_a_tokenizer_reads_text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("a b " * 60)
    data = TextDataset.from_file(path, 4, vocab=word_level({"a": 0, "[UNK]": 1, "b": 5}))
    assert set(data.train.tolist()) == {0, 5}


def test_text_dataset_sample_and_window_loader_need_a_generator():
    data = TextDataset(TEXT, 8)
    for bad in (None, 5, np.random.RandomState(0)):
        with pytest.raises(ConfigError, match="rng must be a numpy.random.Generator"):
            data.sample("train", 2, bad)
        with pytest.raises(ConfigError, match="WindowLoader.epoch: rng must be"):
            data.loader("train", 2).epoch(bad)  # refused at the call, before any batch
    with pytest.raises(ConfigError, match="dataset must be a TextDataset, got NoneType"):
        WindowLoader(None, "train", 2)


# -- ArrayDataset ---------------------------------------------------------------------
def test_array_dataset_refuses_ragged_lists_and_arrays_of_objects():
    with pytest.raises(DTypeError, match="array 1 is ragged"):
        ArrayDataset(np.zeros(2), [[1, 2], [3]])
    for bad in (np.array([{}, {}]), [1, None]):
        with pytest.raises(DTypeError, match="array 0 holds Python objects"):
            ArrayDataset(bad)
    ds = ArrayDataset(np.array([True, False]), np.arange(2), np.ones(2, np.float16))
    assert len(ds) == 2
    labels = ArrayDataset(np.zeros((2, 3)), np.array(["cat", "dog"]))  # for a loss_fn
    assert labels[np.array([1])][1].tolist() == ["dog"]


def test_array_dataset_split_checks_fraction_and_rng_before_drawing():
    ds = ArrayDataset(np.arange(10))
    rng = np.random.default_rng(0)
    before = rng_state(rng)
    for bad in ("0.5", None, True):
        with pytest.raises(ConfigError, match=f"fraction must be a real number, got {bad!r}"):
            ds.split(bad, rng)
    assert rng_state(rng) == before
    with pytest.raises(
        ConfigError, match="split: rng must be a numpy.random.Generator .*got NoneType"
    ):
        ds.split(0.5, None)
    assert [len(d) for d in ds.split(np.float32(0.5), rng)] == [5, 5]


# -- DataLoader -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "dataset", [np.zeros((10, 7)), [(1, 2)] * 10, None, (np.zeros(4), np.zeros(4)), {"x": 1}, "ab"]
)
def test_loader_refuses_what_is_no_dataset(dataset):
    with pytest.raises(
        ConfigError, match=f"got {type(dataset).__name__}; wrap arrays as ArrayDataset"
    ):
        DataLoader(dataset, 4)


class Pairs:
    """A dataset that is no ArrayDataset: len() and [index array] -> a tuple of arrays."""

    def __init__(self, n: int, tuple_items: bool = True) -> None:
        self.x = np.arange(n * 2).reshape(n, 2)
        self.tuple_items = tuple_items

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        return (self.x[index], self.x[index, 0]) if self.tuple_items else self.x[index]


def test_loader_takes_any_dataset_of_array_tuples_and_checks_each_batch():
    loader = DataLoader(Pairs(10), 4, shuffle=False)
    batches = list(loader)
    assert [loader.count(b) for b in batches] == [4, 4, 2]
    assert np.array_equal(batches[0][1], [0, 2, 4, 6])
    bare = DataLoader(Pairs(10, tuple_items=False), 4)
    with pytest.raises(ConfigError, match="must be a tuple of NumPy arrays, got ndarray"):
        next(iter(bare))
    listed = type(
        "Listed", (Pairs,), {"__getitem__": lambda self, i: list(Pairs.__getitem__(self, i))}
    )
    assert isinstance(next(iter(DataLoader(listed(10), 4))), tuple)


@pytest.mark.parametrize("seed", [-1, "a", 1.5, True, None])
def test_loader_seed_is_an_integer_at_least_zero(seed):
    with pytest.raises(
        HyperparameterError, match=rf"DataLoader: seed must be .*, got {re.escape(repr(seed))}$"
    ):
        DataLoader(ArrayDataset(np.arange(10)), 2, seed=seed)


def test_loader_seed_takes_numpy_integers_and_flags_take_bools():
    ds = ArrayDataset(np.arange(10))
    a = [b[0].tolist() for b in DataLoader(ds, 3, seed=np.int64(3))]
    assert a == [b[0].tolist() for b in DataLoader(ds, 3, seed=3)]
    for name in ("shuffle", "drop_last"):
        with pytest.raises(HyperparameterError, match=f"{name} must be True or False, got 'no'"):
            DataLoader(ds, 3, **{name: "no"})


def test_loader_epoch_checks_its_generator_at_the_call_and_draws_lazily():
    loader = DataLoader(ArrayDataset(np.arange(10)), 3)
    for bad in (None, 5):
        with pytest.raises(ConfigError, match="DataLoader.epoch: rng must be a numpy.random"):
            loader.epoch(bad)
    legacy = [b[0].tolist() for b in loader.epoch(np.random.RandomState(0))]  # permutation
    assert sorted(sum(legacy, [])) == list(range(10))
    assert [len(d) for d in ArrayDataset(np.arange(10)).split(0.5, np.random.RandomState(0))] == [
        5,
        5,
    ]
    rng = np.random.default_rng(1)
    before = rng_state(rng)
    epoch = loader.epoch(rng)
    assert rng_state(rng) == before  # the order is drawn with the first batch
    assert sorted(np.concatenate([b[0] for b in epoch]).tolist()) == list(range(10))
