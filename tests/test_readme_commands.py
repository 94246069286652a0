"""Every ``tiegrad`` command in the shell blocks of the README and of the docs pages runs
as printed, in order (the README, then the pages in the site's order; a command printed
twice runs once), in one folder; ``tiegrad train`` gets a tiny model and few steps
appended (flags win over the defaults), so the follow-up commands find the run the page
says they find."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from readme_sections import README, docs_pages

TINY_TRAIN = (
    "--corpus-chars 20000 --d-model 8 --layers 1 --heads 2 --seq-len 8 --batch-size 2 "
    "--steps 12 --eval-every 600 --eval-batches 1 --checkpoint-every 600 --sample-every 600 "
    "--no-progress"
).split()


def readme_commands(page: Path = README) -> list[list[str]]:
    """The ``tiegrad`` commands of the ``bash`` blocks of ``page`` (``a && b`` split)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.splitlines():
            for part in line.split("&&"):
                words = shlex.split(part)
                if words and words[0] == "tiegrad":
                    commands.append(words)
    return commands


def documented_commands() -> list[list[str]]:
    """The commands of the README, then of the docs pages, each once."""
    commands: list[list[str]] = []
    for page in [README, *docs_pages()]:
        commands += [c for c in readme_commands(page) if c not in commands]
    return commands


def tiegrad_command() -> list[str]:
    """The installed console script, or the same entry point through the interpreter."""
    script = shutil.which("tiegrad", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-c", "import _tiegrad_launcher as m; m.main()"]


def test_the_readme_names_the_commands_of_the_quick_start():
    names = [c[:2] for c in readme_commands()]
    assert ["tiegrad", "train"] in names and ["tiegrad", "sample"] in names
    assert ["tiegrad", "inspect"] in names and ["tiegrad", "resume"] in names


def test_every_readme_command_runs_as_printed(tmp_path):
    base = tiegrad_command()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for words in documented_commands():
        args = words[1:] + (TINY_TRAIN if words[1:2] == ["train"] else [])
        proc = subprocess.run(
            base + args, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
        )
        assert proc.returncode == 0, f"{shlex.join(words)}\n{proc.stdout}\n{proc.stderr}"
        assert "Traceback" not in proc.stderr, proc.stderr
    assert (tmp_path / "runs" / "latest" / "checkpoints" / "best.safetensors").is_file()
