"""Inputs for the converter fault tests (test_convert_faults*.py): the tiny checkpoint every converter reads (in
our format, exported to transformers and to Megatron-LM), and the checks every refusal passes (exit status 2,
one line on stderr, no output and no staging path left behind)."""

import json
import os
import shutil

from tests.tools import test_convert_checkpoint as base
from tools.convert_checkpoint import main, to_hf, to_megatron

TRACKER = "latest_checkpointed_iteration.txt"


def make_sources(root, tokenizer: dict) -> dict[str, str]:
    """{"ours": a 4-layer GPT-2 style checkpoint (iteration 3) with `tokenizer`, "hf": its transformers export,
    "megatron": its Megatron-LM export at tp 2}, under root (the fixture converter_sources of conftest.py)."""
    ours, hf, megatron = str(root / "ours"), str(root / "hf"), str(root / "megatron")
    base.save_single(base.run_config(base.GPT, tokenizer), ours)
    to_hf(ours, hf)
    to_megatron(ours, megatron, tp=2)
    return {"ours": ours, "hf": hf, "megatron": megatron}


def copy(source: str, tmp_path) -> str:
    """A copy of `source` to damage (tmp_path/in)."""
    target = str(tmp_path / "in")
    shutil.copytree(source, target)
    return target


def refused(capsys, *argv: str) -> str:
    """Run the converter in this process: exit 2, one line on stderr, no output and no staging path left."""
    out = argv[2]
    code = main(list(argv))
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, lines)
    assert not os.path.exists(out) and not staging_paths(out)
    return lines[0].removeprefix("error: ")


def edit_json(path: str, change) -> None:
    """Rewrite a JSON file as change(its value)."""
    with open(path, encoding="utf-8") as handle:
        value = json.load(handle)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(change(value), handle)


def cut(path: str, keep: float = 0.5) -> None:
    """Truncate a file to `keep` of its length (a copy that stopped half way)."""
    with open(path, "rb") as handle:
        data = handle.read()
    with open(path, "wb") as handle:
        handle.write(data[: int(len(data) * keep)])


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)


def staging_paths(out: str) -> list[str]:
    """The staging files and folders of output `out` (`OUT.tmp-<host>-<pid>`) beside it."""
    folder, name = os.path.split(out)
    return [os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(f"{name}.tmp-")]
