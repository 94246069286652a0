"""Chat data (``tiegrad.data.chat``): conversations rendered with a folder's chat
template as transformers renders them, the assistant's tokens found by ``{% generation %}``
blocks or by prefix rendering, and every bad line or template refused by file and line.

The folders hold a byte-level BPE tokenizer trained here by ``tokenizers`` and saved by
transformers' ``PreTrainedTokenizerFast`` with one of two templates: ChatML with
generation blocks (as Qwen's, marked) and a Llama-3-style one without. Nothing is
downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from tiegrad import ConfigError  # noqa: E402
from tiegrad.data import ChatDataset, ChatTemplate, HFTokenizer, read_chat  # noqa: E402
from tiegrad.data import chat as chat_module  # noqa: E402

SPECIAL = [
    "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eot_id|>",
]  # fmt: skip
TEXT = "".join(
    f"user asks {i}; the assistant answers: tied weights are one storage. Héllo ✓ 你好 🙂\n"
    for i in range(30)
)
#: ChatML with the assistant's text (and its end marker) in generation blocks.
CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: Llama 3's layout: bos, a header per message, content trimmed, no generation blocks.
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be system, user or assistant') }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
END = {CHATML: "<|im_end|>", LLAMA3: "<|eot_id|>"}
CONVERSATIONS = {
    "one-turn": [
        {"role": "user", "content": "Héllo ✓"},
        {"role": "assistant", "content": "tied weights 你好"},
    ],
    "system-multi-turn": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "asks 3"},
        {"role": "assistant", "content": "one storage"},
        {"role": "user", "content": "again 🙂"},
        {"role": "assistant", "content": "answers: the storage."},
    ],
    "empty-content": [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
    ],
    "user-last": [
        {"role": "user", "content": "asks"},
        {"role": "assistant", "content": "answers"},
        {"role": "user", "content": "thanks"},
    ],
}


def save_tokenizer(folder, template) -> None:
    """The tokenizer (trained on ``TEXT``) saved by transformers into ``folder`` with
    ``template`` as its chat template (``chat_template.jinja``), bos/eos/pad named."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=template,
    ).save_pretrained(folder)


def write_chat(path, conversations) -> None:
    """``conversations`` as a chat file, one ``{"messages": ...}`` object a line."""
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))


@pytest.fixture(scope="module", params=[CHATML, LLAMA3], ids=["generation-blocks", "prefix"])
def folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    save_tokenizer(folder, request.param)
    return folder, request.param


def ours(folder) -> ChatTemplate:
    return ChatTemplate.from_tokenizer(HFTokenizer.from_directory(folder))


def prefix_mask(tok, messages) -> list[int]:
    """The assistant mask by transformers' prefix rendering: each assistant message's
    tokens follow the longest common prefix of the conversation before it (with the
    generation prompt) and the conversation up to it."""

    def ids(part, prompt=False):
        return tok.apply_chat_template(part, add_generation_prompt=prompt, return_dict=False)

    full = ids(messages)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            before, upto = ids(messages[:i], prompt=True), ids(messages[: i + 1])
            assert upto == full[: len(upto)]
            start = next((k for k, (a, b) in enumerate(zip(before, upto)) if a != b), None)
            start = min(len(before), len(upto)) if start is None else start
            mask[start : len(upto)] = [1] * (len(upto) - start)
    return mask


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_ids_and_assistant_mask_equal_transformers(folder, name):
    """Generation blocks: ``apply_chat_template(..., return_assistant_tokens_mask=True)``;
    without: its prefix rendering. Either way the assistant's tokens decode to each
    assistant message's text and its end marker, nothing else."""
    path, template = folder
    messages = CONVERSATIONS[name]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids, mask = ours(path).tokenize(messages)
    theirs = tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids.tolist() == list(theirs["input_ids"])
    expected = theirs["assistant_masks"] if template == CHATML else prefix_mask(tok, messages)
    assert mask.astype(int).tolist() == list(expected)
    said = "".join(m["content"] + END[template] for m in messages if m["role"] == "assistant")
    assert tok.decode(ids[mask].tolist()) == said


def test_the_template_sees_transformers_variables(tmp_path):
    """The special tokens, ``add_generation_prompt``, ``tojson``'s unescaped output,
    ``namespace``, ``dict``, ``loopcontrols`` and a reasoning text under its other name,
    rendered as transformers renders them."""
    template = (
        "{{ bos_token }}{{ eos_token }}{{ pad_token }}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{{ m | tojson }}{{ m.reasoning_content }}"
        "{% generation %}{{ dict(a=m.role).a }}{% endgeneration %}{% endfor %}"
        "{{ ns.n }}{{ add_generation_prompt }}"
    )
    save_tokenizer(tmp_path, template)
    messages = [
        {"role": "user", "content": "<a & b>"},
        {"role": "assistant", "content": "ok", "thinking": "why"},
    ]
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    rendered = ours(tmp_path).render(messages, add_generation_prompt=True)
    assert rendered == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<a & b>" in rendered and "why" in rendered


def test_a_template_in_tokenizer_config_and_named_templates_are_found(tmp_path):
    """``tokenizer_config.json``'s ``chat_template`` (a string, or named templates of
    which the default) when there is no ``chat_template.jinja``, which wins otherwise."""
    save_tokenizer(tmp_path, LLAMA3)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    (tmp_path / "chat_template.jinja").unlink()
    messages = CONVERSATIONS["one-turn"]
    for value in (CHATML, [{"name": "default", "template": CHATML}, {"name": "x", "template": ""}]):
        config_path.write_text(json.dumps({**config, "chat_template": value}))
        template = ours(tmp_path)
        assert template.marks_generation and "tokenizer_config.json" in template.where
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
        assert template.render(messages) == tok.apply_chat_template(messages, tokenize=False)
    (tmp_path / "chat_template.jinja").write_text(LLAMA3)
    template = ours(tmp_path)
    assert template.where == "chat_template.jinja" and not template.marks_generation


@pytest.mark.parametrize(
    "value, fragments",
    [
        (None, ("no chat template",)),
        ({"tool_use": CHATML, "other": CHATML}, ("'other', 'tool_use'", "none is 'default'")),
        (7, ("chat_template must be a template", "7")),
    ],
    ids=["none", "no-default", "a-number"],
)
def test_a_missing_or_unusable_template_is_refused(tmp_path, value, fragments):
    save_tokenizer(tmp_path, CHATML)
    (tmp_path / "chat_template.jinja").unlink()
    config_path = tmp_path / "tokenizer_config.json"
    config_path.write_text(
        json.dumps({**json.loads(config_path.read_text()), "chat_template": value})
    )
    with pytest.raises(ConfigError) as info:
        ours(tmp_path)
    for fragment in fragments:
        assert fragment in str(info.value)


# -- refusals: one ConfigError naming the file and the line -----------------------------------
GOOD = json.dumps({"messages": CONVERSATIONS["one-turn"]})


@pytest.mark.parametrize(
    "line, fragments",
    [
        ('{"messages": [', ("not valid UTF-8 JSON",)),
        ("[1, 2]", ("holds a JSON list, expected an object",)),
        ('{"messages": "hi"}', ("non-empty list of messages", "messages 'hi'")),
        ('{"text": "hi"}', ("no 'messages'",)),
        ('{"messages": []}', ("non-empty list of messages",)),
        ('{"messages": ["hi"]}', ("messages[0] must be an object", "'hi'")),
        ('{"messages": [{"content": "x"}]}', ("messages[0] needs a string 'role'", "none")),
        (
            '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}',
            ("messages[1] needs a string 'content'",),
        ),
        ('{"messages": [{"role": "user", "content": 5}]}', ("'content', got 5",)),
        ('{"messages": [{"role": "user", "content": "x"}]}', ("no 'assistant' message", "'user'")),
        (
            '{"messages": [{"role": "tool", "content": "x"}, '
            '{"role": "assistant", "content": "y"}]}',
            ("raised TemplateError", "roles 'tool', 'assistant'"),
        ),
    ],
    ids=[
        "bad-json", "not-an-object", "not-a-list", "no-messages", "empty", "not-a-message",
        "no-role", "no-content", "content-not-text", "no-assistant", "role-the-template-rejects",
    ],
)  # fmt: skip
def test_a_bad_line_is_one_error_naming_file_and_line(tmp_path, line, fragments):
    save_tokenizer(tmp_path / "model", CHATML)
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join([GOOD, GOOD, line, GOOD]) + "\n")
    with pytest.raises(ConfigError) as info:
        ChatDataset(read_chat(path), ours(tmp_path / "model"), block_size=64, val_fraction=0.25)
    message = str(info.value)
    assert f"{path} line 3" in message and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize(
    "template, fragments",
    [
        ("{{ ''.__class__.__mro__ }}", ("outside jinja2's sandbox", "__class__")),
        ("{{ messages.append(1) }}", ("outside jinja2's sandbox", "append")),
        ("{% set ns = namespace(_x=1) %}", ("outside jinja2's sandbox", "'_x'")),
        ("{{ cycler.__init__.__globals__ }}", ("outside jinja2's sandbox",)),
        ("{{ 1 // 0 }}", ("raised ZeroDivisionError",)),
        ("{{ raise_exception('no chat here') }}", ("raised TemplateError", "no chat here")),
    ],
    ids=["class-mro", "mutate-messages", "namespace-dunder", "globals", "divide", "raises"],
)
def test_a_template_that_raises_or_escapes_is_refused_at_the_first_line(
    tmp_path, template, fragments
):
    save_tokenizer(tmp_path / "model", template)
    path = tmp_path / "chat.jsonl"
    path.write_text(GOOD + "\n" + GOOD + "\n")
    with pytest.raises(ConfigError) as info:
        ChatDataset(read_chat(path), ours(tmp_path / "model"), block_size=64, val_fraction=0.5)
    message = str(info.value)
    assert f"{path} line 1" in message and "chat_template.jinja" in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_a_template_jinja_cannot_compile_names_its_file_and_line(tmp_path):
    save_tokenizer(tmp_path, "{{ bos_token }}\n{% for m in messages %}")
    with pytest.raises(ConfigError) as info:
        ours(tmp_path)
    assert "chat_template.jinja" in str(info.value) and "template line" in str(info.value)


def test_a_template_rewriting_earlier_turns_is_refused_without_generation_blocks(tmp_path):
    """Prefix rendering needs each prefix to encode as the start of the conversation: a
    template marking the last message differently gives no assistant tokens to trust."""
    save_tokenizer(
        tmp_path, "{% for m in messages %}{{ m.content }}{{ '!' if loop.last }}{% endfor %}"
    )
    with pytest.raises(ConfigError) as info:
        ours(tmp_path).tokenize(CONVERSATIONS["system-multi-turn"])
    assert "messages[2]" in str(info.value) and "{% generation %}" in str(info.value)


def test_jinja2_is_imported_only_for_a_template(tmp_path, monkeypatch):
    """The library and the command import without jinja2; a template then asks for it."""
    code = (
        "import sys; sys.modules['jinja2'] = None; import tiegrad, tiegrad.data, tiegrad.cli; "
        "from tiegrad.cli.parser import build_parser; build_parser()"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    save_tokenizer(tmp_path, CHATML)
    monkeypatch.setitem(sys.modules, "jinja2", None)
    monkeypatch.setattr(chat_module, "_jinja", chat_module._jinja.__wrapped__)
    with pytest.raises(ConfigError, match=r"'jinja2' package \(pip install 'tiegrad\[hf\]'\)"):
        ours(tmp_path)


# -- the dataset ---------------------------------------------------------------------------
def test_rows_train_on_the_assistant_tokens_and_pad_on_the_right(folder, tmp_path):
    """Each conversation is one row: inputs its tokens but the last, targets the next
    tokens where they are the assistant's and -100 elsewhere; a batch pads its shorter
    rows with the pad id (inputs) and -100 (targets). The last conversations validate."""
    path, _ = folder
    conversations = [CONVERSATIONS[n] for n in ("one-turn", "system-multi-turn", "empty-content")]
    write_chat(tmp_path / "chat.jsonl", conversations * 2)
    template = ours(path)
    tokenizer = template.tokenizer
    data = ChatDataset(read_chat(tmp_path / "chat.jsonl"), template, 96, val_fraction=0.5)
    assert (len(data.train), len(data.val)) == (3, 3)
    inputs, targets = data.train[np.arange(3)]
    assert inputs.shape == targets.shape
    for row, messages in enumerate(conversations):
        ids, mask = template.tokenize(messages)
        n = len(ids) - 1
        assert inputs[row, :n].tolist() == ids[:-1].tolist()
        assert targets[row, :n].tolist() == np.where(mask, ids, -100)[1:].tolist()
        assert (inputs[row, n:] == tokenizer.pad_token_id).all()
        assert (targets[row, n:] == -100).all()
    batches = data.eval_batches("val", 2, 8)
    assert [len(b[0]) for b in batches] == [2, 1]
    loader = data.loader("train", 2)
    seen = [b for b in loader.epoch(np.random.default_rng(0))]
    assert sum(len(b[0]) for b in seen) == 3
    assert sum(loader.count(b) for b in seen) == data.train.trained > 0


def test_conversations_past_the_context_are_named_not_truncated(tmp_path):
    save_tokenizer(tmp_path / "model", CHATML)
    long = [{"role": "user", "content": "asks " * 40}, {"role": "assistant", "content": "ok"}]
    write_chat(tmp_path / "chat.jsonl", [CONVERSATIONS["one-turn"], long, long, long, long])
    with pytest.raises(ConfigError) as info:
        ChatDataset(read_chat(tmp_path / "chat.jsonl"), ours(tmp_path / "model"), 32, 0.2)
    message = str(info.value)
    assert "4 conversations are longer than block_size + 1 = 33 tokens" in message
    assert "lines 2, 3, 4 and 1 more" in message and "nothing is truncated" in message


def test_too_few_conversations_for_a_split_are_refused(tmp_path):
    save_tokenizer(tmp_path / "model", CHATML)
    write_chat(tmp_path / "chat.jsonl", [CONVERSATIONS["one-turn"]] * 3)
    with pytest.raises(ConfigError, match="3 conversations with val_fraction 0.1"):
        ChatDataset(read_chat(tmp_path / "chat.jsonl"), ours(tmp_path / "model"), 64)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="holds no conversation"):
        read_chat(tmp_path / "empty.jsonl")


def test_a_folder_without_tokenizer_json_has_no_chat_template():
    from tiegrad.data import Vocab

    with pytest.raises(ConfigError, match="needs the folder's tokenizer.json .* Vocab"):
        ChatTemplate.from_tokenizer(Vocab("byte"))
