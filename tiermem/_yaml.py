"""Reading a user's YAML (a ``--config`` file, a ``section.field=value`` override) at bounded
cost.

Note [bounded YAML]: YAML aliases let a few hundred bytes stand for millions of values (an
"alias bomb": each of 7 anchors lists the previous one 9 times is 9^7 = 4.8M strings in 405
bytes). PyYAML builds such a document cheaply, sharing the repeated objects, but anything that
walks the values - a ``repr`` in an error message, a comparison, a copy - expands them (25 s
and 2.5 GB for one error line). Deep nesting (``[[[[...]]]]``) is the other way to make a small
text expensive: PyYAML's composer recurses once per level and ends in ``RecursionError``. So
the loader here counts, while composing, every node as often as aliases repeat it and refuses
a document of more than :data:`MAX_NODES` such nodes, more than :data:`MAX_DEPTH` levels, an
alias of a node that contains it (a cycle), or more than :data:`MAX_FILE_BYTES` of text. A
config holds tens of nodes a few levels deep; the bounds are far above that. Error messages
show values through :func:`tiermem.names.short_repr` (Note [bounded repr]), so a value that is
allowed still prints as one short line.
"""

from __future__ import annotations

import os

import yaml
from yaml.nodes import MappingNode, SequenceNode

MAX_NODES = 100_000
"""Most YAML nodes (scalars, sequences, mappings) a document may hold with aliases expanded."""
MAX_DEPTH = 32
"""Most levels of nesting (the document's top mapping is level 1)."""
MAX_FILE_BYTES = 1 << 20
"""Largest config file read (1 MiB)."""


class YAMLBoundError(ValueError):
    """The YAML text is over one of the bounds of Note [bounded YAML]; ``str()`` is one line
    without the source, which the caller names."""


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses what Note [bounded YAML] refuses while composing."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._depth = 0
        self._sizes: dict[int, tuple[yaml.Node, int]] = {}  # id -> (node kept alive, size)

    def _where(self, mark) -> str:
        return f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""

    def compose_node(self, parent, index):  # noqa: D102 - PyYAML's hook
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None and id(node) not in self._sizes:  # still being composed
                raise YAMLBoundError(f"the alias *{event.anchor} refers to a node that contains "
                                     f"it (a cycle){self._where(event.start_mark)}")
            return super().compose_node(parent, index)  # the anchored node; its parent counts it
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YAMLBoundError(f"nested more than {MAX_DEPTH} levels deep"
                                     f"{self._where(mark)}")
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, SequenceNode):
            children = node.value
        elif isinstance(node, MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        size = 1 + sum(self._sizes[id(child)][1] for child in children)  # aliases: again
        if size > MAX_NODES:
            raise YAMLBoundError(f"holds more than {MAX_NODES:,} values once its aliases are "
                                 f"expanded{self._where(node.start_mark)} (an alias bomb?)")
        self._sizes[id(node)] = (node, size)
        return node


def load_text(text: str, name: str | None = None):
    """Parse one YAML document within the bounds of Note [bounded YAML].

    Args:
        text: the YAML.
        name: the file it came from, named by PyYAML's error marks (None: a string).

    Raises:
        YAMLBoundError: the text is over a bound (the message says which and where).
        yaml.YAMLError: the text is not YAML.
        ValueError: a scalar PyYAML cannot convert (e.g. an int of more than 4300 digits).
    """
    loader = _BoundedLoader(text)
    if name is not None:
        loader.name = name  # yaml.reader.Reader's source name, used in every Mark
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_file(path: str | os.PathLike) -> str:
    """The text of a UTF-8 config file of at most :data:`MAX_FILE_BYTES` bytes.

    Raises:
        OSError: the file cannot be opened or read (a directory, missing, no permission).
        YAMLBoundError: the file is larger than :data:`MAX_FILE_BYTES`.
        UnicodeDecodeError: the file is not UTF-8 text.
    """
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise YAMLBoundError(f"is larger than {MAX_FILE_BYTES >> 20} MiB, far more than a "
                             f"config holds")
    return data.decode("utf-8")
