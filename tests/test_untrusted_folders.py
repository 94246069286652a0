"""Untrusted folders read with bounds (issue 52): Hugging Face and PEFT folders, run
folders, checkpoints.

Every input is written here by transformers, PEFT or tiegrad, then mutated: JSON nested
100000 levels deep, sizes of 10**6 to 10**30 in ``config.json``, sparse 3 GB files
(``truncate``: no disk used), a JSON list where an object belongs, one missing tensor
among thousands of strays, a folder that is a file or cannot be listed. Each refusal is
the library's error type, names the file, stays under ``MESSAGE_LIMIT`` characters, is
fast, and leaves the target as it was (C6). A seeded fuzz run drives every loader with
a few hundred damaged files in a child process under a memory limit.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import tiegrad  # noqa: E402
from tiegrad import CheckpointError, ConfigError, DeviceError, TiegradError  # noqa: E402
from tiegrad.checkpoint.schema import METADATA_KEY  # noqa: E402
from tiegrad.cli import main  # noqa: E402
from tiegrad.errors import shown, shown_list  # noqa: E402
from tiegrad.interop.peft import SHARED, load_adapter  # noqa: E402
from tiegrad.models import GPT2, TiedLM  # noqa: E402
from tiegrad.train import RunDir  # noqa: E402
from tiegrad.train.config import resolve  # noqa: E402
from tiegrad.train.metrics import read_metrics  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_folders import CHECKPOINT_MODEL, same, snapshot  # noqa: E402

TINY = dict(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
MESSAGE_LIMIT = 500
DEEP_OBJECT = '{"a":' * 100_000 + "1" + "}" * 100_000
SPARSE = 3 << 30
#: Memory a refusal may add to the process's peak, and the time it may take.
PEAK_GROWTH = 200 << 20
SECONDS = 5.0


def hf_config(**overrides):
    return transformers.GPT2Config(
        **TINY,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        **overrides,
    )


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """Valid inputs, each written by its own tool: a transformers GPT-2 folder (one file
    and sharded), a PEFT LoRA adapter of it, a tiegrad checkpoint and a run folder."""
    root = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_config()).eval()
    hf.save_pretrained(root / "gpt2")
    hf.save_pretrained(root / "sharded", max_shard_size="20KB")
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's fan_in_fan_out notice
        peft.get_peft_model(hf, lora).save_pretrained(root / "adapter")
    tiegrad.save(root / "checkpoint.safetensors", TiedLM(**CHECKPOINT_MODEL))
    run = RunDir(root / "run")
    run.write_config({"steps": 3, "seq_len": 6, "text": ""})
    records = [{"step": s, "train_loss": 2.0 / s} for s in (1, 2, 3)]
    (root / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def copy(sources: Path, name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    source = sources / name
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copyfile(source, target)
    return target


def refused(load, error: type[TiegradError], *fragments: str) -> str:
    """``load()`` raises ``error`` whose short message holds every fragment, quickly and
    without a peak of memory."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    with pytest.raises(error) as info:
        load()
    elapsed = time.perf_counter() - start
    message = str(info.value)
    assert len(message) < MESSAGE_LIMIT, message[:1000]
    for fragment in fragments:
        assert fragment in message, message
    assert elapsed < SECONDS, (elapsed, message)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak
    assert grown < PEAK_GROWTH, (grown, message)
    return message


def refused_unchanged(model, load, error: type[TiegradError], *fragments: str) -> str:
    """``refused``, and ``model`` keeps every value, tie, trainability and storage (C6)."""
    before = snapshot(model)
    message = refused(load, error, *fragments)
    assert same(before, snapshot(model))
    return message


def rewrite_safetensors(path: Path, metadata: dict[str, str] | None = None, edit=None) -> None:
    """Rewrite a safetensors file with safetensors itself: ``edit(tensors)`` applied and
    ``metadata`` merged into its own."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    with safe_open(str(path), "np") as f:
        kept = f.metadata() or {}
    tensors = load_file(path)
    if edit is not None:
        edit(tensors)
    save_file(tensors, path, {**kept, **(metadata or {})})


# -- JSON nested 100000 levels deep -----------------------------------------------------------
def deep_in_hf_config(sources, tmp_path):
    folder = copy(sources, "gpt2", tmp_path)
    (folder / "config.json").write_text(DEEP_OBJECT)
    refused(lambda: GPT2.from_pretrained(folder), CheckpointError, f"{folder / 'config.json'}")


def deep_in_index(sources, tmp_path):
    folder = copy(sources, "sharded", tmp_path)
    (folder / "model.safetensors.index.json").write_text(DEEP_OBJECT)
    model = GPT2.from_pretrained(sources / "gpt2")
    index = f"{folder / 'model.safetensors.index.json'}"
    refused_unchanged(model, lambda: model.load_pretrained(folder), CheckpointError, index)


def deep_in_adapter_config(sources, tmp_path):
    folder = copy(sources, "adapter", tmp_path)
    (folder / "adapter_config.json").write_text(DEEP_OBJECT)
    model = GPT2.from_pretrained(sources / "gpt2")
    where = f"{folder / 'adapter_config.json'}"
    refused_unchanged(model, lambda: load_adapter(model, folder), CheckpointError, where)


def deep_in_adapter_metadata(sources, tmp_path):
    folder = copy(sources, "adapter", tmp_path)
    rewrite_safetensors(folder / "adapter_model.safetensors", {SHARED: "[" * 100_000})
    model = GPT2.from_pretrained(sources / "gpt2")
    where = f"{folder / 'adapter_model.safetensors'}: metadata {SHARED}"
    refused_unchanged(model, lambda: load_adapter(model, folder), CheckpointError, where)


def deep_in_checkpoint_schema(sources, tmp_path):
    path = copy(sources, "checkpoint.safetensors", tmp_path)
    rewrite_safetensors(path, {METADATA_KEY: DEEP_OBJECT})
    model = TiedLM(**CHECKPOINT_MODEL)
    refused_unchanged(model, lambda: tiegrad.load(path, model), CheckpointError, str(path))


def deep_in_run_config(sources, tmp_path):
    folder = copy(sources, "run", tmp_path)
    (folder / "config.json").write_text(DEEP_OBJECT)
    refused(lambda: RunDir(folder).read_config(), ConfigError, f"{folder / 'config.json'}")


def deep_in_a_metrics_line(sources, tmp_path):
    folder = copy(sources, "run", tmp_path)
    path = folder / "metrics.jsonl"
    path.write_text(DEEP_OBJECT + "\n" + path.read_text())
    refused(lambda: read_metrics(path), ConfigError, f"{path}: line 1")


def deep_in_a_toml_config(sources, tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("steps = " + "[" * 100_000 + "]" * 100_000 + "\n")
    refused(lambda: resolve(path), ConfigError, str(path))


@pytest.mark.parametrize(
    "case",
    [
        deep_in_hf_config,
        deep_in_index,
        deep_in_adapter_config,
        deep_in_adapter_metadata,
        deep_in_checkpoint_schema,
        deep_in_run_config,
        deep_in_a_metrics_line,
        deep_in_a_toml_config,
    ],
)
def test_deep_nesting_is_a_library_error_naming_the_file(sources, tmp_path, case):
    case(sources, tmp_path)


# -- sizes in config.json against the tensors ------------------------------------------------
@pytest.mark.parametrize(
    "key, value",
    [
        ("n_layer", 10**6),
        ("n_layer", 10**30),
        ("n_embd", 10**9),
        ("vocab_size", 10**12),
        ("n_positions", 10**9),
        ("n_inner", 10**30),
    ],
)
def test_sizes_beyond_the_tensors_are_refused_before_any_layout(sources, tmp_path, key, value):
    folder = copy(sources, "gpt2", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    n_head = {"n_embd": 10**9}.get(key, config["n_head"])  # n_head must divide n_embd
    (folder / "config.json").write_text(json.dumps(dict(config, n_head=n_head, **{key: value})))
    refused(
        lambda: GPT2.from_pretrained(folder),
        CheckpointError,
        f"{folder / 'config.json'}: {key}={value} but the weights hold",
    )


def test_train_init_refuses_a_huge_config_in_one_line_and_creates_no_run(sources, tmp_path, capsys):
    folder = copy(sources, "gpt2", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, n_layer=10**6)))
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n" * 50)
    run = tmp_path / "run"
    args = ["train", "--init", folder, "--text", tmp_path / "text.txt", "--run", run]
    code, err = cli(capsys, *args, "--steps", 1, "--seq-len", 8, "--no-progress")
    assert code == 2 and err.startswith("tiegrad: error: ") and len(err.splitlines()) == 1, err
    assert f"{folder / 'config.json'}: n_layer=1000000 but the weights hold 2" in err
    assert len(err) < MESSAGE_LIMIT and not run.exists()


def cli(capsys, *args) -> tuple[int, str]:
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_the_command_names_the_flag_a_rule_refuses(capsys, tmp_path):
    code, err = cli(capsys, "train", "--heads", 3, "--run", tmp_path / "run")
    assert code == 2 and "--heads (3) must divide d_model (128)" in err, err
    code, err = cli(capsys, "train", "--lr", 0.1, "--min-lr", 0.2, "--run", tmp_path / "run")
    assert code == 2 and "--min-lr (0.2) exceeds --lr (0.1)" in err, err
    assert not (tmp_path / "run").exists()


# -- sparse 3 GB files -----------------------------------------------------------------------
def sparse(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(SPARSE)


def test_a_sparse_3gb_config_json_is_refused_by_its_size(sources, tmp_path):
    folder = copy(sources, "gpt2", tmp_path)
    sparse(folder / "config.json")
    refused(
        lambda: GPT2.from_pretrained(folder),
        CheckpointError,
        f"{folder / 'config.json'}: {SPARSE} bytes, more than the",
    )


def test_a_sparse_3gb_adapter_config_is_refused_by_its_size(sources, tmp_path):
    folder = copy(sources, "adapter", tmp_path)
    sparse(folder / "adapter_config.json")
    model = GPT2.from_pretrained(sources / "gpt2")
    where = f"{folder / 'adapter_config.json'}: {SPARSE} bytes, more than the"
    refused_unchanged(model, lambda: load_adapter(model, folder), CheckpointError, where)


def test_a_sparse_3gb_safetensors_with_a_lying_header_length_is_refused_from_8_bytes(
    sources, tmp_path
):
    folder = copy(sources, "gpt2", tmp_path)
    path = folder / "model.safetensors"
    sparse(path)
    with open(path, "r+b") as f:  # a header as long as the file allows: 3 GB of zeros
        f.write((SPARSE - 8).to_bytes(8, "little"))
    model = GPT2.from_pretrained(sources / "gpt2")
    refused_unchanged(
        model,
        lambda: model.load_pretrained(folder),
        CheckpointError,
        f"checkpoint {path}: header length {SPARSE - 8} exceeds",
    )


def test_a_sparse_3gb_safetensors_whose_header_tells_less_is_refused_unread(sources, tmp_path):
    folder = copy(sources, "gpt2", tmp_path)
    path = folder / "model.safetensors"
    size = path.stat().st_size
    sparse(path)  # the header is intact; 3 GB of data follow that it does not describe
    model = GPT2.from_pretrained(sources / "gpt2")
    refused_unchanged(
        model,
        lambda: model.load_pretrained(folder),
        CheckpointError,
        f"checkpoint {path}: {SPARSE - size} trailing bytes",
    )


@pytest.mark.parametrize("damage", ["deep", "sparse", "list"])
def test_a_bad_tokenizer_json_is_refused_naming_its_folder(tmp_path, damage):
    """The tokenizer ``train --init DIR`` reads beside the model."""
    from tiegrad.data import directory_tokenizer

    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    if damage == "sparse":
        path.write_text("{}")
        sparse(path)
    else:
        path.write_text(DEEP_OBJECT if damage == "deep" else "[1, 2]")
    fragment = {"sparse": f"{SPARSE} bytes, more than the"}.get(damage, "tokenizer.json")
    refused(lambda: directory_tokenizer(tmp_path), ConfigError, f"{tmp_path}", fragment)


# -- a JSON document of another type ----------------------------------------------------------
@pytest.mark.parametrize("doc, kind", [([1, 2], "list"), (7, "number"), ("gpt2", "string")])
def test_a_json_document_of_another_type_is_named_as_what_it_is(sources, tmp_path, doc, kind):
    folder = copy(sources, "gpt2", tmp_path)
    (folder / "config.json").write_text(json.dumps(doc))
    where = f"{folder / 'config.json'} holds a JSON {kind}, expected an object"
    refused(lambda: GPT2.from_pretrained(folder), CheckpointError, where)
    adapter = copy(sources, "adapter", tmp_path)
    (adapter / "adapter_config.json").write_text(json.dumps(doc))
    model = GPT2.from_pretrained(sources / "gpt2")
    where = f"{adapter / 'adapter_config.json'} holds a JSON {kind}, expected an object"
    refused_unchanged(model, lambda: load_adapter(model, adapter), CheckpointError, where)
    sharded = copy(sources, "sharded", tmp_path)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(doc))
    where = f"{sharded / 'model.safetensors.index.json'} holds a JSON {kind}"
    refused_unchanged(model, lambda: model.load_pretrained(sharded), CheckpointError, where)


# -- a missing tensor among many ----------------------------------------------------------------
def test_one_missing_tensor_among_thousands_of_strays_is_named_in_a_short_message(
    sources, tmp_path
):
    folder = copy(sources, "gpt2", tmp_path)

    def edit(tensors):
        del tensors[next(k for k in tensors if k.endswith("h.1.mlp.c_fc.weight"))]
        for i in range(3000):
            tensors[f"stray.{i:04d}.weight"] = np.zeros(1, np.float32)

    rewrite_safetensors(folder / "model.safetensors", edit=edit)
    model = GPT2.from_pretrained(sources / "gpt2")
    for load in (lambda: GPT2.from_pretrained(folder), lambda: model.load_pretrained(folder)):
        message = refused_unchanged(
            model, load, CheckpointError, str(folder), "'transformer.h.1.mlp.c_fc.weight'"
        )
        assert "unexpected 'transformer.stray." in message and "and 2997 more" in message


def test_shown_list_names_a_few_and_counts_the_rest():
    assert shown_list([]) == "none"
    assert shown_list(["a", "b"]) == "'a', 'b'"
    assert shown_list([f"n{i}" for i in range(10)]) == "'n0', 'n1', 'n2' and 7 more"
    assert len(shown_list(["x" * 10**6] * 3)) < 200
    assert shown(10**5000) == f"an integer of {(10**5000).bit_length()} bits"


# -- folders that cannot be read ---------------------------------------------------------------
def test_a_file_given_for_a_folder_is_a_library_error(sources, tmp_path):
    file = copy(sources, "gpt2", tmp_path) / "config.json"
    refused(lambda: GPT2.from_pretrained(file), CheckpointError, f"{file}: not a folder")
    model = GPT2.from_pretrained(sources / "gpt2")
    refused_unchanged(model, lambda: model.load_pretrained(file), CheckpointError, str(file))
    refused_unchanged(model, lambda: load_adapter(model, file), CheckpointError, str(file))
    refused(lambda: GPT2.from_pretrained(tmp_path / "absent"), CheckpointError, "no such folder")


def test_a_folder_that_cannot_be_listed_is_a_library_error(sources, tmp_path, monkeypatch):
    """A chmod 000 folder. Root lists it anyway, so as root the listing is made to fail
    with the EACCES any other user meets: there the test shows that the error is turned
    into the library's, not that the system refuses."""
    folder = copy(sources, "gpt2", tmp_path)
    if os.geteuid() == 0:
        listdir = os.listdir

        def unreadable(path):
            if Path(path) == folder:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return listdir(path)

        monkeypatch.setattr(os, "listdir", unreadable)
    folder.chmod(0)
    try:
        refused(
            lambda: GPT2.from_pretrained(folder),
            CheckpointError,
            f"{folder}: cannot list the folder: Permission denied",
        )
    finally:
        folder.chmod(0o755)


# -- the hint for a missing torch ---------------------------------------------------------------
def test_the_torch_hint_names_the_pinned_cpu_build(monkeypatch):
    from tiegrad import backend

    pins = Path(__file__).parent.parent / "constraints.txt"
    pin = next(line for line in pins.read_text().splitlines() if line.startswith("torch=="))
    monkeypatch.setattr(backend, "_DEVICE_BACKENDS", {})
    monkeypatch.setitem(sys.modules, "tiegrad.backend.torch_backend", None)  # import fails
    with pytest.raises(DeviceError) as info:
        backend.device_backend("torch:cpu")
    assert f"pip install -c constraints.txt '{pin}'" in str(info.value)
    assert "tiegrad[torch]" not in str(info.value)


# -- fuzz ---------------------------------------------------------------------------------------
def test_damaged_files_load_or_raise_a_library_error_within_bounds(sources, tmp_path):
    """300 seeded mutations over every loader, in a child under a 3 GB address-space
    limit: each loads or raises a ``TiegradError`` leaving the target unchanged; no other
    exception, no ``MemoryError``, no timeout."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    script = Path(__file__).parent / "fuzz_folders.py"
    args = [sys.executable, str(script), str(sources), str(scratch), "52", "300", str(3 << 30)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert time.perf_counter() - start < 90
    counts = json.loads(proc.stdout.splitlines()[-1])
    assert sum(counts.values()) == 300
    assert set(counts) - {"loaded"} <= {"CheckpointError", "ConfigError"}, counts
    assert counts.get("CheckpointError", 0) > 100, counts


# -- crafted bytes that would cost time, or a file that changes under the reader --------------


def test_an_unclosed_string_of_escapes_is_refused_in_linear_time():
    from tiegrad.checkpoint.fileio import parse_json

    raw = b"[" * 101 + b'"' + b'\\"' * 2_000_000  # 4 MB: quadratic scanning would take hours
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="x.json"):
        parse_json(raw, "x.json")
    assert time.perf_counter() - start < SECONDS


def test_a_safetensors_file_cut_short_after_its_header_was_read_is_a_library_error(tmp_path):
    from safetensors.numpy import save_file

    from tiegrad.checkpoint.fileio import read_safetensors

    path = tmp_path / "model.safetensors"
    save_file({"a": np.arange(100_000, dtype=np.float32)}, str(path))
    file = read_safetensors(str(path))
    os.truncate(path, 4096)  # a copy over the file in place, meanwhile
    with pytest.raises(CheckpointError, match="changed size"):
        file.array("a")


@pytest.mark.parametrize("kind", [["llama"], {"a": 1}, 3])
def test_a_model_type_that_is_not_a_string_is_a_config_error(tmp_path, kind):
    from tiegrad.models import from_pretrained

    (tmp_path / "config.json").write_text(json.dumps({"model_type": kind}))
    with pytest.raises(ConfigError, match="model_type"):
        from_pretrained(tmp_path)


def test_a_deeply_nested_tokenizer_config_is_a_config_error():
    tokenizers = pytest.importorskip("tokenizers")
    from tiegrad.data.tokenizer import HFTokenizer

    vocab = tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")
    files = {"tokenizer.json": tokenizers.Tokenizer(vocab).to_str()}
    HFTokenizer(files)  # the tokenizer alone loads
    with pytest.raises(ConfigError, match="tokenizer_config.json"):
        HFTokenizer({**files, "tokenizer_config.json": DEEP_OBJECT})
