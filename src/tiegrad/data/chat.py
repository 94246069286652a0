"""Chat data: conversations rendered with a model folder's chat template, labels on the
assistant's tokens alone.

A chat file is JSON Lines, one conversation a line: ``{"messages": [{"role": ...,
"content": ...}, ...]}`` (other keys of the line are ignored; a message's other keys,
such as ``tool_calls``, reach the template). ``read_chat`` reads it through the bounded
readers of ``checkpoint.fileio`` (each line at most ``MAX_JSON_BYTES`` and
``MAX_JSON_DEPTH`` deep, no repeated keys).

``ChatTemplate`` compiles the folder's ``chat_template`` (``chat_template.jinja``, else
``tokenizer_config.json``'s ``chat_template``; of named templates the ``"default"``) in
jinja2's ``ImmutableSandboxedEnvironment`` exactly as transformers'
``apply_chat_template`` does: ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols``
extension and a ``{% generation %}`` tag, the globals ``raise_exception``,
``strftime_now``, ``dict`` and ``namespace`` (no names starting with ``_``), a ``tojson``
filter that does not escape HTML, and the variables ``messages``, ``tools`` and
``documents`` (None), ``add_generation_prompt`` and the tokenizer's named special tokens
(``bos_token``, ``eos_token``, ...). The rendered text is encoded without added special
tokens, as transformers encodes it.

The assistant mask (``ChatTemplate.tokenize``):

- a template with ``{% generation %}`` blocks: the tokens whose character span overlaps
  the text a block rendered, as ``apply_chat_template(..., return_assistant_tokens_mask=
  True)`` maps them;
- a template without: prefix rendering. For each assistant message, the conversation
  before it is rendered with ``add_generation_prompt=True`` and the conversation up to and
  including it without; its tokens are those of the second after the longest common
  prefix of the two token lists (what the model generates after the prompt: its text and
  the end-of-turn marker, not the role header the prompt holds). The second must encode
  as the start of the whole conversation's tokens, else the template rewrites earlier
  turns and the conversation is refused (mark the template's assistant text with
  ``{% generation %}`` instead).

``ChatDataset`` holds the tokenized conversations of a file: each one a row of inputs
(its tokens but the last) and targets (the next tokens, ``-100`` where the next token is
not the assistant's, ``IGNORE``), a batch padded on the right to its longest row (the
padding's targets ``-100``: causal attention keeps padding out of every earlier
position). The last ``val_fraction`` of the conversations is held out for validation.

Every refusal is one ``ConfigError`` naming the file and line (and the message index or
role), raised while the dataset is built, before anything trains (C6): a line that is
not a JSON object with a non-empty message list, a message without a string role or
content, a conversation without an assistant message or whose assistant tokens are all
cut off, a template that raises (``raise_exception`` rejecting a role) or reaches outside
the sandbox (jinja2's ``SecurityError``), and conversations longer than ``block_size + 1``
tokens (all of them named in one error: nothing is truncated). jinja2 (the ``hf`` extra)
is imported when a template is compiled.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint.fileio import MAX_JSON_BYTES, open_regular, parse_json
from ..errors import ConfigError, shown, shown_list
from .loader import Batch, DataLoader, check_fraction, check_positive
from .tokenizer import HFTokenizer, check_path

#: The target of a position whose next token is not the assistant's (``loss``'s default).
IGNORE = -100
#: The role whose messages are trained on.
ASSISTANT = "assistant"
#: The oldest jinja2 without known sandbox escapes (transformers refuses older ones too).
MIN_JINJA2 = (3, 1, 6)
#: transformers' test of whether a template marks the assistant's text.
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
#: Names a message's reasoning goes by; templates read the first (transformers aliases them).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@functools.cache
def _jinja() -> Any:
    """The jinja2 module, checked to be at least ``MIN_JINJA2``; else a ``ConfigError``."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ConfigError(
            "chat templates need the 'jinja2' package (pip install 'tiegrad[hf]')"
        ) from None
    found = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
    if found < MIN_JINJA2:
        raise ConfigError(
            f"chat templates need jinja2 >= {'.'.join(map(str, MIN_JINJA2))} (older versions "
            f"have known sandbox escapes), found {jinja2.__version__}"
        )
    return jinja2


def _environment() -> Any:
    """A sandboxed environment as transformers builds one for chat templates (module
    docstring), whose ``generation_tracking`` is ``(blocks, spans)`` while a render
    records the character spans of its ``{% generation %}`` blocks, else None."""
    jinja2 = _jinja()

    class GenerationTracker(jinja2.ext.Extension):  # type: ignore[misc, name-defined]
        """``{% generation %}...{% endgeneration %}``: renders its body and, while a render
        tracks, appends the body's span in the text rendered so far."""

        tags = {"generation"}

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            environment.extend(generation_tracking=None)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_generation", [])
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _generation(self, caller: Callable[[], str]) -> str:
            text = caller()
            tracking = self.environment.generation_tracking
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

    class TemplateDict:
        """``dict(...)`` and ``dict.fromkeys(...)`` without the type's other attributes."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # type: ignore[misc, name-defined]
        """jinja2's ``namespace`` refusing attribute names that start with ``_``."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature: self in args
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template cannot set the attribute {name!r} (starting with '_') "
                    "on a namespace"
                )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTracker, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def _check_tokenizer(tokenizer: Any) -> HFTokenizer:
    """``tokenizer`` when it is an ``HFTokenizer`` (a folder's ``tokenizer.json``), else a
    ``ConfigError``: the byte and character vocabularies have no chat template."""
    if not isinstance(tokenizer, HFTokenizer):
        raise ConfigError(
            "chat data needs the folder's tokenizer.json and its chat template, got a "
            f"{type(tokenizer).__name__} tokenizer"
        )
    return tokenizer


def template_source(tokenizer: HFTokenizer) -> tuple[str, str]:
    """``(template text, where it comes from)`` of a tokenizer's files, chosen as
    transformers chooses: ``chat_template.jinja`` first, else ``tokenizer_config.json``'s
    ``chat_template`` (a string; or named templates, a list of ``{"name", "template"}``
    objects or an object, of which the ``"default"`` one). None, or named templates
    without a default, is a ``ConfigError`` naming the file and the names there are."""
    files = tokenizer.files
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"], "chat_template.jinja"
    where = "tokenizer_config.json"
    config = files.get(where)
    value = (
        None
        if config is None
        else parse_json(config, where, dict, ConfigError).get("chat_template")
    )
    if value is None:
        raise ConfigError(
            "the tokenizer has no chat template (neither a chat_template.jinja nor a "
            "chat_template in tokenizer_config.json)"
        )
    if isinstance(value, str):
        return value, f"{where}'s chat_template"
    named = value
    if isinstance(value, list) and all(
        isinstance(v, dict) and set(v) == {"name", "template"} for v in value
    ):
        named = {v["name"]: v["template"] for v in value}
    if not isinstance(named, dict) or not all(isinstance(v, str) for v in named.values()):
        raise ConfigError(
            f"{where}: chat_template must be a template, a list of {{'name', 'template'}} "
            f"objects or an object of named templates, got {shown(value)}"
        )
    if "default" not in named:
        raise ConfigError(
            f"{where}: of the named chat templates ({shown_list(sorted(named))}) none is "
            "'default', the one used for training"
        )
    return named["default"], f"{where}'s chat_template 'default'"


@dataclass
class Conversation:
    """One line of a chat file: its number (from 1) and its checked messages."""

    line: int
    messages: list[dict[str, Any]]


class ChatTemplate:
    """A chat template compiled in jinja2's sandbox, bound to the tokenizer it encodes
    with (module docstring). ``where`` names the template's file in errors;
    ``marks_generation`` says whether it has ``{% generation %}`` blocks (which then give
    the assistant mask). A template that jinja2 cannot compile is a ``ConfigError``
    naming ``where`` and the template's line."""

    def __init__(self, source: str, where: str, tokenizer: HFTokenizer) -> None:
        if not isinstance(source, str):
            raise ConfigError(f"{where}: a chat template must be text, got {shown(source)}")
        _check_tokenizer(tokenizer)
        jinja2 = _jinja()
        self.environment = _environment()
        try:
            self.template = self.environment.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ConfigError(
                f"{where}: the chat template is not valid jinja (template line {e.lineno}): "
                f"{shown(e.message, 120)}"
            ) from None
        self.where = where
        self.tokenizer = tokenizer
        self.marks_generation = bool(_GENERATION_TAG.search(source))

    @classmethod
    def from_tokenizer(cls, tokenizer: HFTokenizer) -> ChatTemplate:
        """The template of the tokenizer's files (``template_source``)."""
        return cls(*template_source(_check_tokenizer(tokenizer)), tokenizer)

    def _variables(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> Any:
        return {
            **self.tokenizer.template_tokens,
            "messages": _aliased(messages),
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The text of ``messages``; a template that raises is a ``ConfigError`` (one
        that reaches outside the sandbox says so), naming ``where``."""
        return self._run(
            lambda: self.template.render(**self._variables(messages, add_generation_prompt))
        )

    def render_spans(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The text of ``messages`` and the character spans its ``{% generation %}``
        blocks rendered, in order (as transformers records them)."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []

        def run() -> str:
            self.environment.generation_tracking = (blocks, spans)
            try:
                for block in self.template.generate(**self._variables(messages, False)):
                    blocks.append(block)
            finally:
                self.environment.generation_tracking = None
            return "".join(blocks)

        return self._run(run), spans

    def _run(self, render: Callable[[], str]) -> str:
        jinja2 = _jinja()
        try:
            return render()
        except jinja2.exceptions.SecurityError as e:
            raise ConfigError(
                f"the chat template ({self.where}) reached outside jinja2's sandbox: "
                f"{shown(str(e), 120)}"
            ) from None
        except Exception as e:  # a template runs arbitrary expressions: any error is its
            raise ConfigError(
                f"the chat template ({self.where}) raised {type(e).__name__}: {shown(str(e), 120)}"
            ) from None

    def tokenize(self, messages: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)`` of a conversation: its token ids (int64) and whether each is
        the assistant's (bool), by generation blocks or prefix rendering (module
        docstring). A template rendering earlier turns otherwise once an assistant
        message follows is a ``ConfigError`` naming the message."""
        if self.marks_generation:
            text, spans = self.render_spans(messages)
            ids, offsets = self.tokenizer.encode_with_offsets(text)
            return ids, _span_mask(offsets, spans)
        ids = self.tokenizer.encode(self.render(messages))
        mask = np.zeros(len(ids), dtype=bool)
        for i, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            prompt = self.tokenizer.encode(self.render(messages[:i], add_generation_prompt=True))
            upto = self.tokenizer.encode(self.render(messages[: i + 1]))
            if len(upto) > len(ids) or not np.array_equal(upto, ids[: len(upto)]):
                raise ConfigError(
                    f"the chat template ({self.where}) renders the conversation up to "
                    f"messages[{i}] (an assistant message) as other tokens than the start of "
                    "the whole conversation, so prefix rendering cannot find the assistant's "
                    "tokens; mark them with {% generation %} in the template"
                )
            mask[_common_prefix(prompt, upto) : len(upto)] = True
        return ids, mask


def _aliased(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as transformers hands them to a template: a reasoning text given under
    any name of ``_REASONING_FIELDS`` is also ``thinking`` and ``reasoning_content``."""
    out = []
    for message in messages:
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of two id arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _span_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """Whether each token (its ``[start, end)`` characters) overlaps a span, the spans in
    order: transformers' single pass of ``apply_chat_template``."""
    mask = np.zeros(len(offsets), dtype=bool)
    k = 0
    for t, (start, end) in enumerate(offsets.tolist()):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[t] = end > spans[k][0]
    return mask


# -- the file ------------------------------------------------------------------------------


@dataclass
class ChatFile:
    """The conversations of a chat file, its path and the SHA-256 of its bytes."""

    path: str
    conversations: list[Conversation]
    sha256: str


def read_chat(path: str | os.PathLike[str]) -> ChatFile:
    """The conversations of the JSON Lines file ``path`` (module docstring); blank lines
    are skipped. Each line is checked (``check_messages``); the first defect, and a file
    without any conversation, is a ``ConfigError`` naming the file and the line."""
    where = os.fspath(check_path("read_chat", "path", path))
    digest = hashlib.sha256()
    conversations = []
    with io.BufferedReader(open_regular(where, where, ConfigError)) as f:
        for n, raw in enumerate(iter(lambda: f.readline(MAX_JSON_BYTES + 1), b""), 1):
            digest.update(raw)
            what = f"{where} line {n}"
            if len(raw) > MAX_JSON_BYTES:
                raise ConfigError(f"{what}: longer than the {MAX_JSON_BYTES} bytes a line may hold")
            if not raw.strip():
                continue
            line = parse_json(raw, what, dict, ConfigError)
            conversations.append(Conversation(n, check_messages(line, what)))
    if not conversations:
        raise ConfigError(f"{where}: holds no conversation (one JSON object a line)")
    return ChatFile(where, conversations, digest.hexdigest())


def check_messages(line: dict[str, Any], what: str) -> list[dict[str, Any]]:
    """The messages of one parsed line: ``line["messages"]``, a non-empty list of
    objects, each with a string ``role`` and ``content``, at least one of them the
    assistant's; keys whose value is null are dropped (as transformers drops them).
    Anything else is a ``ConfigError`` naming ``what`` and the key."""
    messages = line.get("messages")
    if not isinstance(messages, list) or not messages:
        found = "no 'messages'" if "messages" not in line else f"messages {shown(messages)}"
        raise ConfigError(
            f'{what}: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}}, a '
            f"non-empty list of messages, got {found}"
        )
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConfigError(f"{what}: messages[{i}] must be an object, got {shown(message)}")
        message = {k: v for k, v in message.items() if v is not None}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = shown(message[key]) if key in message else "none"
                raise ConfigError(f"{what}: messages[{i}] needs a string {key!r}, got {got}")
        out.append(message)
    if not any(m["role"] == ASSISTANT for m in out):
        raise ConfigError(
            f"{what}: no {ASSISTANT!r} message (roles {shown_list(m['role'] for m in out)}): "
            "nothing to train on"
        )
    return out


# -- the dataset ---------------------------------------------------------------------------


class ChatRows:
    """Tokenized conversations as next-token rows: ``rows[indices]`` is ``(inputs,
    targets)`` of shape ``(len(indices), longest)``, padded on the right with ``pad_id``
    (inputs) and ``IGNORE`` (targets): a dataset for ``DataLoader``."""

    def __init__(self, rows: list[tuple[np.ndarray, np.ndarray]], pad_id: int) -> None:
        self.rows = rows
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: Any) -> Batch:
        picked = [self.rows[i] for i in np.arange(len(self.rows))[index].reshape(-1)]
        width = max(len(inputs) for inputs, _ in picked)
        inputs = np.full((len(picked), width), self.pad_id, dtype=np.int64)
        targets = np.full((len(picked), width), IGNORE, dtype=np.int64)
        for r, (x, y) in enumerate(picked):
            inputs[r, : len(x)] = x
            targets[r, : len(y)] = y
        return inputs, targets

    @property
    def tokens(self) -> int:
        """The positions of all rows (their inputs' tokens)."""
        return sum(len(x) for x, _ in self.rows)

    @property
    def trained(self) -> int:
        """The targets that are the assistant's (not ``IGNORE``)."""
        return sum(int((y != IGNORE).sum()) for _, y in self.rows)


class ChatLoader(DataLoader):
    """Shuffled batches of ``ChatRows``; throughput counts the targets trained on."""

    unit = "tokens"

    def count(self, batch: Batch) -> int:
        """The assistant targets of ``batch`` (those the loss is taken over)."""
        return int((batch[1] != IGNORE).sum())


class ChatDataset:
    """The conversations of a chat file (``read_chat``) tokenized with ``template`` (a
    ``ChatTemplate``, e.g. ``ChatTemplate.from_tokenizer(tokenizer)``), split in order:
    the last ``val_fraction`` of them for validation (module docstring).

    Each conversation is a row of at most ``block_size`` positions (``block_size + 1``
    tokens) with an assistant target; ``vocab`` is the template's tokenizer. The padding
    id is the tokenizer's pad token, else its eos token, else 0 (any id: its targets are
    ignored).
    """

    def __init__(
        self,
        chat: ChatFile,
        template: ChatTemplate,
        block_size: int,
        val_fraction: float = 0.1,
    ) -> None:
        self.block_size = check_positive("ChatDataset: block_size", block_size)
        if not isinstance(chat, ChatFile):
            raise ConfigError(
                f"ChatDataset: chat must be a ChatFile (read_chat), got {shown(chat)}"
            )
        if not isinstance(template, ChatTemplate):
            raise ConfigError(
                f"ChatDataset: template must be a ChatTemplate, got {type(template).__name__}"
            )
        val_fraction = check_fraction("ChatDataset: val_fraction", val_fraction)
        n_val = int(len(chat.conversations) * val_fraction)
        if n_val < 1 or n_val >= len(chat.conversations):
            raise ConfigError(
                f"{chat.path}: {len(chat.conversations)} conversations with val_fraction "
                f"{val_fraction} leave none for training or validation (each needs one)"
            )
        rows, too_long = [], []
        for c in chat.conversations:
            what = f"{chat.path} line {c.line}"
            try:
                ids, mask = template.tokenize(c.messages)
            except ConfigError as e:
                raise ConfigError(
                    f"{what}: {e} (roles {shown_list(m['role'] for m in c.messages)})"
                ) from None
            if len(ids) > self.block_size + 1:
                too_long.append((c.line, len(ids)))
                continue
            targets = np.where(mask, ids, IGNORE)[1:]
            if not (targets != IGNORE).any():
                raise ConfigError(
                    f"{what}: the chat template ({template.where}) gives the assistant no "
                    "token after the first position: nothing to train on"
                )
            rows.append((ids[:-1], targets))
        if too_long:
            lines, longest = shown_list(n for n, _ in too_long), max(t for _, t in too_long)
            raise ConfigError(
                f"{chat.path}: {len(too_long)} conversations are longer than block_size + 1 = "
                f"{self.block_size + 1} tokens (the context, --seq-len, plus one): lines "
                f"{lines} (the longest {longest} tokens); nothing is truncated: raise the "
                "context or shorten them"
            )
        tokenizer = template.tokenizer
        self.vocab = tokenizer
        self.template = template
        self.path = chat.path
        pad = next(
            (i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0
        )
        self.train = ChatRows(rows[: len(rows) - n_val], pad)
        self.val = ChatRows(rows[len(rows) - n_val :], pad)

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    def rows(self, split: str) -> ChatRows:
        """The rows of ``"train"`` or ``"val"``."""
        if split not in ("train", "val"):
            raise ConfigError(f"ChatDataset: unknown split {split!r}, expected 'train' or 'val'")
        return self.train if split == "train" else self.val

    def loader(
        self, split: str, batch_size: int, rank: int | None = None, world_size: int | None = None
    ) -> ChatLoader:
        """Shuffled batches of ``split``'s conversations for the trainer (with several
        processes, this rank's shard of each global batch)."""
        return ChatLoader(self.rows(split), batch_size, rank=rank, world_size=world_size)

    def eval_batches(self, split: str, batch_size: int, max_batches: int) -> list[Batch]:
        """Fixed batches of ``split``'s first conversations, in order (the same on every
        call), at most ``max_batches`` of them."""
        batch_size = check_positive("ChatDataset: batch_size", batch_size)
        max_batches = check_positive("ChatDataset: max_batches", max_batches)
        rows = self.rows(split)
        n = min(len(rows), batch_size * max_batches)
        return [rows[k : min(k + batch_size, n)] for k in range(0, n, batch_size)]

    def __repr__(self) -> str:
        return (
            f"ChatDataset({Path(self.path).name!r}, block_size={self.block_size}, "
            f"train={len(self.train)}, val={len(self.val)} conversations)"
        )
