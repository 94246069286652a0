"""Seeded mutations of valid files fed to tiegrad's loaders, under a memory limit (issue 52).

Run by ``test_untrusted_folders`` as a child process::

    python fuzz_folders.py SOURCES SCRATCH SEED CASES MEMORY_BYTES

``SOURCES`` holds valid inputs that transformers, PEFT and tiegrad wrote (``gpt2/``,
``sharded/``, ``adapter/``, ``checkpoint.safetensors``, ``run/``). Each case copies one
target into ``SCRATCH``, mutates one of its files (byte flips, a truncation, a sparse
extension, or one JSON value replaced, in a file or in a safetensors header) and runs
the loader. A case passes when the loader succeeds or raises a ``TiegradError`` and, on
an error, leaves its target model as it was (C6). The address space is capped first
(``RLIMIT_AS``), so a blow-up is a ``MemoryError`` here, not a swapping machine. Any
other exception is a traceback naming the case (exit 1); at the end one JSON line
counts the outcomes.
"""

from __future__ import annotations

import resource
import sys

if __name__ == "__main__":  # before anything large is imported
    limit = int(sys.argv[5])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

import json  # noqa: E402
import shutil  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import tiegrad  # noqa: E402
from tiegrad import TiegradError  # noqa: E402
from tiegrad.interop.peft import load_adapter  # noqa: E402
from tiegrad.models import GPT2, TiedLM  # noqa: E402
from tiegrad.train import RunDir  # noqa: E402
from tiegrad.train.metrics import read_metrics  # noqa: E402

#: The model ``checkpoint.safetensors`` holds (the test writes it from this too).
CHECKPOINT_MODEL = dict(vocab_size=11, d_model=8, n_layers=1, n_heads=2, max_seq_len=6)
#: Stand-in for a document nested 1000 levels deep (JSON's encoder would recurse).
DEEP = "<deep>"
VALUES = [
    10**30, 2**63, 10**6, -1, 0, 1, 3.5, 1e308, None, True, "", "x", "\ud800", "gpt2",
    "LORA", "F32", [], {}, [1, 2], [10**30], {"a": 1}, DEEP,
]  # fmt: skip


def snapshot(model) -> list:
    """Every slot's path, value, trainability and storage, and the ties."""
    slots = [(k, p.value.copy(), p.requires_grad, id(p.storage)) for k, p in model.named_slots()]
    return [slots, model.aliases()]


def same(a: list, b: list) -> bool:
    (slots_a, ties_a), (slots_b, ties_b) = a, b
    return ties_a == ties_b and all(
        (k, rg, st) == (k2, rg2, st2) and np.array_equal(v, v2, equal_nan=True)
        for (k, v, rg, st), (k2, v2, rg2, st2) in zip(slots_a, slots_b, strict=True)
    )


def attempt(*loads: Callable[[], object]) -> None:
    """Run every load; re-raise the first ``TiegradError`` once all have run."""
    refusals = []
    for load in loads:
        try:
            load()
        except TiegradError as e:
            refusals.append(e)
    if refusals:
        raise refusals[0]


def unchanged(model, load: Callable[[], object]) -> Callable[[], None]:
    """``load`` checked: a ``TiegradError`` must leave ``model`` as it was (C6)."""

    def checked() -> None:
        before = snapshot(model)
        try:
            load()
        except TiegradError:
            assert same(before, snapshot(model)), "a refused load changed the model"
            raise

    return checked


def load_gpt2(folder: Path, sources: Path) -> None:
    model = GPT2.from_pretrained(sources / "gpt2")
    attempt(
        lambda: GPT2.from_pretrained(folder),
        unchanged(model, lambda: model.load_pretrained(folder)),
    )


def load_peft(folder: Path, sources: Path) -> None:
    model = GPT2.from_pretrained(sources / "gpt2")
    attempt(unchanged(model, lambda: load_adapter(model, folder)))


def load_checkpoint(path: Path, sources: Path) -> None:
    model = TiedLM(**CHECKPOINT_MODEL)
    attempt(unchanged(model, lambda: tiegrad.load(path, model)))


def load_run(folder: Path, sources: Path) -> None:
    attempt(lambda: RunDir(folder).read_config(), lambda: read_metrics(folder / "metrics.jsonl"))


#: target -> (its files, the loader).
TARGETS: dict[str, tuple[list[str], Callable[[Path, Path], None]]] = {
    "gpt2": (["config.json", "model.safetensors"], load_gpt2),
    "sharded": (["model.safetensors.index.json", "*.safetensors"], load_gpt2),
    "adapter": (["adapter_config.json", "adapter_model.safetensors"], load_peft),
    "checkpoint.safetensors": ([""], load_checkpoint),
    "run": (["config.json", "metrics.jsonl"], load_run),
}


def replace_value(doc, rng: np.random.Generator):
    """``doc`` with one node (chosen at random, the root excluded) replaced by a value
    of ``VALUES``."""
    nodes = []

    def walk(node, parent, key) -> None:
        if parent is not None:
            nodes.append((parent, key))
        if isinstance(node, (dict, list)):
            for k, child in list(node.items() if isinstance(node, dict) else enumerate(node)):
                walk(child, node, k)

    walk(doc, None, None)
    if nodes:
        parent, key = nodes[rng.integers(len(nodes))]
        parent[key] = VALUES[rng.integers(len(VALUES))]
    return doc


def dumps(doc) -> bytes:
    text = json.dumps(doc)
    return text.replace(json.dumps(DEEP), "[" * 1000 + "]" * 1000).encode("utf-8")


def mutate(path: Path, rng: np.random.Generator) -> str:
    """Damage the file at ``path`` one way; returns how."""
    raw = path.read_bytes()
    kind = ["flip", "truncate", "extend", "value"][rng.integers(4)]
    if kind == "flip":
        data = bytearray(raw)
        for i in rng.integers(len(data), size=rng.integers(1, 4)):
            data[i] ^= int(rng.integers(1, 256))
        path.write_bytes(bytes(data))
    elif kind == "truncate":
        path.write_bytes(raw[: rng.integers(len(raw))])
    elif kind == "extend":  # sparse: costs no disk
        with open(path, "r+b") as f:
            f.truncate(len(raw) + int(rng.integers(1, 3 << 30)))
    elif path.suffix == ".safetensors":
        n = int.from_bytes(raw[:8], "little")
        header = dumps(replace_value(json.loads(raw[8 : 8 + n]), rng))
        path.write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n :])
    elif path.suffix == ".jsonl":
        lines = raw.splitlines(keepends=True)
        i = rng.integers(len(lines))
        lines[i] = dumps(replace_value(json.loads(lines[i]), rng)) + b"\n"
        path.write_bytes(b"".join(lines))
    else:
        path.write_bytes(dumps(replace_value(json.loads(raw), rng)))
    return kind


def run(sources: Path, scratch: Path, seed: int, cases: int) -> Counter:
    outcomes: Counter = Counter()
    names = sorted(TARGETS)
    for case in range(cases):
        rng = np.random.default_rng([seed, case])
        name = names[case % len(names)]
        patterns, load = TARGETS[name]
        target = scratch / f"case{case}-{name}"
        source = sources / name
        if source.is_dir():
            shutil.copytree(source, target)
            files = sorted(f for p in patterns for f in target.glob(p))
            victim = files[rng.integers(len(files))]
        else:
            shutil.copyfile(source, target)
            victim = target
        how = mutate(victim, rng)
        try:
            load(target, sources)
            outcomes["loaded"] += 1
        except TiegradError as e:
            outcomes[type(e).__name__] += 1
        except BaseException:
            print(f"case {case}: {name}/{victim.name} after {how}", file=sys.stderr)
            raise
        finally:
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    return outcomes


if __name__ == "__main__":
    counts = run(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    print(json.dumps(dict(counts)))
