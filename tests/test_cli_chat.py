"""``tiegrad train --init DIR --chat FILE.jsonl`` end to end on a tiny tied Qwen2-style
folder: the loss sees the assistant's tokens alone (the targets handed to ``loss`` are
transformers' ids with -100 off the assistant mask), with LoRA and without, resumed and
exported with the chat template; a bad line or template is one line, exit 2, and nothing
is trained or written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import numpy as np
import pytest
from test_chat_data import CHATML, CONVERSATIONS, LLAMA3, prefix_mask, save_tokenizer, write_chat
from test_cli import files_of
from test_untrusted_input import assert_one_line_error, cli

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from tiegrad.cli import main  # noqa: E402
from tiegrad.models import LlamaLM  # noqa: E402

#: Ten conversations: the last one validates (val_fraction 0.1).
CHATS = [CONVERSATIONS[n] for n in ("one-turn", "system-multi-turn", "empty-content")] * 3 + [
    CONVERSATIONS["user-last"]
]
TRAIN = [
    "--chat", "chat.jsonl", "--steps", "3", "--seq-len", "96", "--batch-size", "4",
    "--eval-every", "3", "--eval-batches", "1", "--checkpoint-every", "3",
    "--warmup-steps", "1", "--lr", "0.01", "--sample-every", "0", "--no-progress",
]  # fmt: skip
LORA = ["--lora", "rank=2,targets=q_proj,v_proj"]


def chat_folder(folder, template) -> None:
    """A tiny tied Qwen2 model (hidden 32, 2 layers, GQA 4/2, 128 positions) whose
    tokenizer has ``template`` as its chat template."""
    save_tokenizer(folder, template)
    vocab = len(folder_tokenizer(folder))
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
    ).save_pretrained(folder)  # fmt: skip


def folder_tokenizer(folder):
    """The folder's tokenizer.json as transformers reads it. (``AutoTokenizer`` of a
    folder whose config.json says ``qwen2`` builds a ``Qwen2Tokenizer`` with Qwen2's own
    pre-tokenizer in place of the file's, which splits digits apart.)"""
    return transformers.PreTrainedTokenizerFast.from_pretrained(folder)


def expected_rows(folder, template) -> list[tuple[list[int], list[int]]]:
    """``(inputs, targets)`` of each conversation by transformers: its ids but the last,
    and the next ids where the assistant mask (generation blocks, or prefix rendering)
    holds, -100 elsewhere."""
    tok = folder_tokenizer(folder)
    rows = []
    for messages in CHATS:
        out = tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = np.array(out["input_ids"])
        mask = out["assistant_masks"] if template == CHATML else prefix_mask(tok, messages)
        rows.append((ids[:-1].tolist(), np.where(np.array(mask, bool), ids, -100)[1:].tolist()))
    return rows


@pytest.fixture(scope="module", params=[(CHATML, LORA), (LLAMA3, [])], ids=["lora", "full"])
def trained(request, tmp_path_factory):
    """A 3-step ``train --init --chat`` run (ChatML with generation blocks and LoRA on
    q_proj and v_proj; the Llama-3-style template, every weight training), the batches
    handed to ``LlamaLM.loss`` and what the command printed."""
    template, extra = request.param
    root = tmp_path_factory.mktemp("cli_chat")
    chat_folder(root / "model", template)
    write_chat(root / "chat.jsonl", CHATS)
    seen = []
    loss = LlamaLM.loss

    def recording(self, session, idx, targets, **kwargs):
        seen.append((np.array(idx), np.array(targets)))
        return loss(self, session, idx, targets, **kwargs)

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.chdir(root)
        mp.setattr(LlamaLM, "loss", recording)
        assert main(["train", "--init", "model", "--run", "run", *TRAIN, *extra]) == 0
    return root, template, seen, out.getvalue()


@pytest.fixture
def work(trained, tmp_path, monkeypatch):
    """A copy of the trained folder, the current directory."""
    shutil.copytree(trained[0], tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_loss_sees_the_assistant_tokens_alone(trained):
    """Every row handed to the loss (training and validation) is one conversation's
    inputs and targets as transformers' ids and assistant mask give them, padded on the
    right with targets -100; each conversation is seen."""
    root, template, seen, printed = trained
    rows = expected_rows(root / "model", template)
    matched = set()
    for inputs, targets in seen:
        assert inputs.shape == targets.shape and inputs.shape[1] <= 96
        for x, y in zip(inputs.tolist(), targets.tolist()):
            found = [
                k for k, (ex, ey) in enumerate(rows)
                if x[: len(ex)] == ex and y[: len(ey)] == ey and set(y[len(ey):]) <= {-100}
            ]  # fmt: skip
            assert found, (x, y)
            matched.update(found)
    assert matched == set(range(len(rows)))
    by = "generation blocks" if template == CHATML else "prefix rendering"
    assert "train 9 / val 1 conversations" in printed and f"assistant tokens by {by}" in printed
    assert "done: 3 steps" in printed


def test_resume_renders_the_chat_file_again(work, capsys):
    (work / "model").rename(work / "moved")  # the run holds the tokenizer and its template
    code, out, err = cli(capsys, "resume", "run", "--steps", 4, "--no-progress")
    assert code == 0, out + err
    assert "done: 4 steps" in out and "conversations" in out


def test_an_export_keeps_the_chat_template(work, capsys):
    """The exported folder's tokenizer renders conversations as the --init folder's (a
    LoRA run's export merges its adapters)."""
    lora = json.loads((work / "run" / "config.json").read_text())["lora"]
    args = ["--merge"] if lora else []
    code, out, err = cli(capsys, "export", "run", "out", "--format", "hf", *args)
    assert code == 0, out + err
    theirs, mine = folder_tokenizer(work / "out"), folder_tokenizer(work / "model")
    messages = CONVERSATIONS["system-multi-turn"]
    assert theirs.apply_chat_template(messages, tokenize=False) == mine.apply_chat_template(
        messages, tokenize=False
    )


BAD_LINE = '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}'
TOOL = '{"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}'


@pytest.mark.parametrize(
    "line, args, fragments",
    [
        ('{"messages": [', [], ("chat.jsonl line 4", "not valid UTF-8 JSON")),
        ('{"messages": "hi"}', [], ("chat.jsonl line 4", "non-empty list of messages")),
        (BAD_LINE, [], ("chat.jsonl line 4", "messages[1] needs a string 'content'")),
        (TOOL, [], ("chat.jsonl line 4", "raised TemplateError", "'tool'")),
        (None, ["--init", ""], ("--chat", "--init DIR")),
        (None, ["--text", "chat.jsonl"], ("--chat", "--text", "do not go together")),
    ],
    ids=["bad-json", "not-a-list", "no-content", "role-rejected", "no-init", "with-text"],
)
def test_a_refused_chat_run_is_one_line_and_trains_nothing(work, capsys, line, args, fragments):
    if line is not None:
        lines = (work / "chat.jsonl").read_text().splitlines()
        lines[3] = line
        (work / "chat.jsonl").write_text("\n".join(lines) + "\n")
    before = files_of(work)
    result = cli(capsys, "train", "--init", "model", "--run", "again", *TRAIN, *args)
    assert_one_line_error(result, *fragments)
    assert files_of(work) == before and not (work / "again").exists()


@pytest.mark.parametrize(
    "template, fragments",
    [
        ("{{ ''.__class__.__mro__ }}", ("chat.jsonl line 1", "outside jinja2's sandbox")),
        (None, ("model", "no chat template")),
    ],
    ids=["escape", "none"],
)
def test_a_template_reaching_outside_the_sandbox_or_none_trains_nothing(
    work, capsys, template, fragments
):
    path = work / "model" / "chat_template.jinja"
    if template is None:
        path.unlink()
    else:
        path.write_text(template)
    before = files_of(work)
    result = cli(capsys, "train", "--init", "model", "--run", "again", *TRAIN)
    assert_one_line_error(result, *fragments)
    assert files_of(work) == before and not (work / "again").exists()
