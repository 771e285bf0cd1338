"""docs/configuration.md is generated from the schema's dataclasses: it lists every key with its type, default
and the description its field declares, and a schema change without regenerating it fails here."""

from __future__ import annotations

import copy
import dataclasses
import re
import typing
from types import MappingProxyType

import pytest

from config.schema import Config, RunConfig
from tools import config_reference

pytestmark = pytest.mark.tier("fast")

ROW = re.compile(r"^\| `([a-z_]+\.[a-z_0-9]+)` \| ([^|]+) \| `([^`]*)` \| (.+) \|$")


def committed_rows() -> dict[str, tuple[str, str, str]]:
    """key -> (type, default, description) as the committed page holds them."""
    with open(config_reference.PAGE, encoding="utf-8") as handle:
        matches = (ROW.match(line) for line in handle.read().splitlines())
        return {m.group(1): (m.group(2), m.group(3), m.group(4)) for m in matches if m}


def schema_defaults() -> dict[str, object]:
    """section.key -> default, read from the dataclasses directly (not through the generator)."""
    defaults: dict[str, object] = {}
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        for field in dataclasses.fields(cls):
            factory = field.default_factory
            defaults[f"{section.name}.{field.name}"] = (
                factory() if factory is not dataclasses.MISSING else field.default
            )
    return defaults


def test_committed_page_equals_a_fresh_one():
    with open(config_reference.PAGE, encoding="utf-8") as handle:
        assert handle.read() == config_reference.render(), "run: python tools/config_reference.py --write"
    assert config_reference.main(["--check"]) == 0


def test_every_key_appears_with_its_default_and_a_description():
    rows, defaults = committed_rows(), schema_defaults()
    assert set(rows) == set(defaults), "keys on the page and in the schema differ"
    for key, value in defaults.items():
        if value is None:
            expected = "null"
        elif isinstance(value, bool):
            expected = str(value).lower()
        else:
            expected = "[]" if value == [] else str(value)
        assert rows[key][1] == expected, f"{key}: page says {rows[key][1]!r}, schema {value!r}"
        assert rows[key][2].strip(), f"{key} has no description"


def test_every_field_of_every_section_declares_its_description():
    """Each key is described once, where it is declared: its field's metadata; each section by its docstring."""
    sections = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        cls = sections[section.name]
        assert config_reference.section_doc(section.name, cls), section.name
        for field in dataclasses.fields(cls):
            doc = field.metadata.get("doc")
            assert isinstance(doc, str) and doc.strip(), f"{section.name}.{field.name} declares no doc"


def test_a_key_without_description_is_an_error(monkeypatch, capsys):
    undocumented = copy.copy(RunConfig.__dataclass_fields__["dir"])
    undocumented.metadata = MappingProxyType({})
    monkeypatch.setitem(RunConfig.__dataclass_fields__, "dir", undocumented)
    with pytest.raises(KeyError, match=r"run\.dir has no description"):
        config_reference.render()
    assert config_reference.main([]) == 2
    assert capsys.readouterr().err.startswith("error: run.dir has no description")


def test_a_section_without_docstring_is_an_error():
    @dataclasses.dataclass
    class Bare:
        size: int = 1

    with pytest.raises(KeyError, match=r"section bare \(Bare\) has no docstring"):
        config_reference.section_doc("bare", Bare)


@pytest.mark.parametrize(
    ("annotation", "text"),
    [(int, "int"), (int | None, "int or null"), (list[str] | None, "list of str or null"), (bool | str, "bool or str")],
)
def test_type_names(annotation, text):
    assert config_reference.type_name(annotation) == text
