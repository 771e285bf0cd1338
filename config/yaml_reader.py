"""Reading a YAML file strictly: one document of text, no key given twice in one mapping.

PyYAML's safe loader lets the last of two equal keys win silently (a section written twice loses the
first one's keys), and a binary file fails deep inside its reader. Here both are one line naming the
file, the line and the key.
"""

from __future__ import annotations

from typing import Any

import yaml


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key repeated in one mapping (sections and keys alike)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may repeat what it merges
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} on line {line} (first on line {seen[key]})", key_node.start_mark
                )
            if isinstance(key, (str, int, float, bool)):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _duplicate_message(err: yaml.MarkedYAMLError) -> str | None:
    problem = err.problem or ""
    return problem if problem.startswith("duplicate key") else None


def read_yaml_file(path: str, kind: str, error: type[Exception]) -> Any:
    """The YAML document of `path`; an unreadable, binary or non-UTF-8 file, bad YAML or a key given twice
    in one mapping raises `error` with one line naming the `kind` of file ("config", "cluster") and the
    path (and the line and key where there is one)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as err:
        raise error(f"cannot read {kind} file {path}: {err.strerror}") from None
    if b"\0" in raw:
        raise error(f"{kind} file {path} is a binary file, not YAML text: give the path of a .yaml file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{kind} file {path} is not UTF-8 text (byte {err.start}): save it as UTF-8 YAML") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.MarkedYAMLError as err:
        duplicate = _duplicate_message(err)
        if duplicate is not None:
            raise error(f"{kind} file {path}: {duplicate}: give each key (and section) once") from None
        raise error(f"{kind} file {path} is not valid YAML: {' '.join(str(err).split())}") from None
    except yaml.YAMLError as err:
        raise error(f"{kind} file {path} is not valid YAML: {' '.join(str(err).split())}") from None
