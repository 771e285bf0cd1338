"""Reading YAML strictly and boundedly: one document of text, no key given twice in one mapping, aliases
that expand to a bounded size, nesting of bounded depth.

PyYAML's safe loader lets the last of two equal keys win silently (a section written twice loses the
first one's keys), and a binary file fails deep inside its reader. Here both are one line naming the
file, the line and the key.

Aliases (`*name`) are shared, not copied, while loading, so a "billion laughs" document of a few lines
loads at once; whatever walks the result later (str(), dataclasses.asdict, a blend-list parser) expands
it until memory runs out. So the composed node graph is measured before anything is built: each alias
counts as a full copy of what it names, and the document may grow by at most MAX_ALIAS_EXPANSION values
that way; an alias naming its own ancestor (a cycle) is refused. Nesting past MAX_DEPTH levels (counted
through aliases too) is refused before PyYAML's recursive composer, or a later walk, hits Python's
recursion limit.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_DEPTH = 64  # a config nests 2-3 levels, a cluster spec 3-4
MAX_FILE_BYTES = 16 << 20  # a config is a few KB; a blend list of 100,000 prefixes a few MB
MAX_ALIAS_EXPANSION = 10_000  # values aliases may add to a document (merge keys `<<: *base` included)


class YamlBoundError(yaml.YAMLError):
    """A document past a bound (alias expansion, nesting depth, an alias cycle); str() is one line."""


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expansion(root: yaml.Node, literal_nodes: int) -> None:
    """Refuse `root` when its aliases, expanded, exceed the bounds (iterative: the graph may be deep)."""
    limit = literal_nodes + MAX_ALIAS_EXPANSION
    size: dict[int, int] = {}  # id(node) -> values once every alias below it is expanded
    depth: dict[int, int] = {}
    on_path: set[int] = set()  # nodes whose children are being measured: an alias to one is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        line = node.start_mark.line + 1
        if children_done:
            kids = _children(node)
            size[key] = 1 + sum(size[id(kid)] for kid in kids)
            depth[key] = 1 + max((depth[id(kid)] for kid in kids), default=0)
            on_path.discard(key)
            if size[key] > limit:
                raise YamlBoundError(
                    f"aliases (*name) expand to more than {MAX_ALIAS_EXPANSION:,} values (line {line}): "
                    f"write the values out instead of repeating aliases"
                )
            if depth[key] > MAX_DEPTH:
                raise YamlBoundError(f"nested deeper than {MAX_DEPTH} levels through aliases (line {line})")
            continue
        if key in size:
            continue
        if key in on_path:
            raise YamlBoundError(f"an alias (*name) names a value that holds it (line {line}): remove the cycle")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((kid, False) for kid in _children(node) if id(kid) not in size)


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key repeated in one mapping (sections and keys alike), nesting past
    MAX_DEPTH and aliases that expand past MAX_ALIAS_EXPANSION values."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._literal_nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            return super().compose_node(parent, index)
        self._literal_nodes += 1
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlBoundError(f"nested deeper than {MAX_DEPTH} levels (line {mark.line + 1})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _check_expansion(node, self._literal_nodes)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[str | int | float | bool, int] = {}
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


def load_yaml_text(text: str) -> object:
    """The YAML document of `text`, loaded strictly and boundedly (see the module docstring); anything wrong
    raises a yaml.YAMLError (YamlBoundError for a bound) whose str() names the line."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except ValueError as err:  # inside PyYAML's constructor: int() past 4,300 digits, a date like 2024-02-30
        raise YamlBoundError(f"a value cannot be read ({str(err).split(';')[0]})") from None


def _duplicate_message(err: yaml.MarkedYAMLError) -> str | None:
    problem = err.problem or ""
    return problem if problem.startswith("duplicate key") else None


def read_yaml_file(path: str, kind: str, error: type[Exception]) -> Any:
    """The YAML document of `path`; an unreadable, binary or non-UTF-8 file, bad YAML, a key given twice
    in one mapping or a document past a bound raises `error` with one line naming the `kind` of file
    ("config", "cluster") and the path (and the line and key where there is one)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)  # bounded: /dev/zero or a huge file is not read to the end
    except OSError as err:
        raise error(f"cannot read {kind} file {path}: {err.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise error(f"{kind} file {path} is larger than {MAX_FILE_BYTES >> 20} MiB: give the path of a .yaml file")
    if b"\0" in raw:
        raise error(f"{kind} file {path} is a binary file, not YAML text: give the path of a .yaml file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{kind} file {path} is not UTF-8 text (byte {err.start}): save it as UTF-8 YAML") from None
    try:
        return load_yaml_text(text)
    except YamlBoundError as err:
        raise error(f"{kind} file {path}: {err}") from None
    except yaml.MarkedYAMLError as err:
        duplicate = _duplicate_message(err)
        if duplicate is not None:
            raise error(f"{kind} file {path}: {duplicate}: give each key (and section) once") from None
        raise error(f"{kind} file {path} is not valid YAML: {' '.join(str(err).split())}") from None
    except yaml.YAMLError as err:
        raise error(f"{kind} file {path} is not valid YAML: {' '.join(str(err).split())}") from None
