"""Generate docs/configuration.md, the reference of every config key, from config/schema.py.

    python tools/config_reference.py            # print the page
    python tools/config_reference.py --write    # write docs/configuration.md
    python tools/config_reference.py --check    # exit 1 when docs/configuration.md differs from the schema

Sections, keys, types and defaults come from the dataclasses (dataclasses.fields, typing.get_type_hints); what
each key does comes from config/key_docs.py. A key without a text there is an error (exit 2), so the page
cannot silently leave one out. tests/tools/test_config_reference.py runs the check.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing

from config.key_docs import KEY_DOCS, SECTION_DOCS
from config.schema import Config

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "configuration.md")

HEADER = """\
# Configuration reference

Every section and key of the run configuration, with its type and default. Generated from `config/schema.py`
(types, defaults) and `config/key_docs.py` (what each key does) by `python tools/config_reference.py --write`;
do not edit by hand: `tests/tools/test_config_reference.py` fails when this page and the schema disagree.

A run takes a YAML file (`--config configs/NAME.yaml`, the sections below) and `section.key=value` overrides
(values read as YAML: `true`, `null`, `[a, b]`), e.g.
`python pretrain_gpt.py --config configs/llama_tiny.yaml train.train_iters=50 optim.lr=1e-3`. The defaults below
are the schema's, what a key left out of the file gets; `python pretrain_gpt.py` with no `--config` reads
`configs/gpt_tiny.yaml`, which sets some of them (8 layers, no dropout, lr 0.003, a checkpoint every 100
iterations, ...). Keys are checked
strictly: an unknown key names the closest known one, a wrong type names the key and the type expected.
Layout rules (sizes against the model and the world size) are in `parallel/layout.py`; Megatron-LM's flags and
the keys that replace them are in [megatron_flags.md](megatron_flags.md).
"""


def type_name(annotation: object) -> str:
    """A field annotation as a reader writes it in YAML: `int or null`, `list of str`, `bool or str`."""
    if annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(arg) for arg in typing.get_args(annotation))
    if origin is list:
        (item,) = typing.get_args(annotation)
        return f"list of {type_name(item)}"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: dataclasses.Field) -> str:
    """A field's default in YAML spelling."""
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        value = field.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(str(item) for item in value) + "]"
    return str(value)


def section_rows(section: str, cls: type) -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) of every field of one section's dataclass."""
    hints = typing.get_type_hints(cls)
    docs = KEY_DOCS.get(section, {})
    rows = []
    for field in dataclasses.fields(cls):
        text = docs.get(field.name, "").strip()
        if not text:
            raise KeyError(f"{section}.{field.name} has no description in config/key_docs.py: write one")
        rows.append((f"{section}.{field.name}", type_name(hints[field.name]), default_text(field), text))
    return rows


def schema_sections() -> list[tuple[str, type]]:
    """(section name, its dataclass) in the order of Config's fields."""
    hints = typing.get_type_hints(Config)
    return [(field.name, hints[field.name]) for field in dataclasses.fields(Config)]


def render() -> str:
    """The whole page."""
    lines = [HEADER]
    for section, cls in schema_sections():
        lines += [f"## {section}", "", SECTION_DOCS[section], "", "| key | type | default | what it does |"]
        lines.append("|---|---|---|---|")
        for key, type_text, default, text in section_rows(section, cls):
            lines.append(f"| `{key}` | {type_text} | `{default}` | {text.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {os.path.relpath(PAGE)}")
    mode.add_argument("--check", action="store_true", help="exit 1 when the committed page differs")
    args = parser.parse_args(argv)
    try:
        page = render()
    except KeyError as err:
        print(f"error: {err.args[0]}", file=sys.stderr)
        return 2
    if args.write:
        with open(PAGE + ".tmp", "w", encoding="utf-8") as handle:
            handle.write(page)
        os.replace(PAGE + ".tmp", PAGE)
        print(f"wrote {PAGE}")
        return 0
    if args.check:
        try:
            with open(PAGE, encoding="utf-8") as handle:
                committed = handle.read()
        except OSError as err:
            print(f"error: cannot read {PAGE}: {err.strerror}", file=sys.stderr)
            return 1
        if committed != page:
            print(f"{PAGE} is out of date: run python tools/config_reference.py --write", file=sys.stderr)
            return 1
        print(f"{PAGE} matches config/schema.py")
        return 0
    sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
