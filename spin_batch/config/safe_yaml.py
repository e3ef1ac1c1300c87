"""YAML as job files and ``--set`` values are read: PyYAML's safe loader, with two refusals.

- A key given twice in one mapping (at any level) is refused, naming the key and both lines:
  with plain PyYAML the last one wins silently. Keys a merge (``<<: *base``) brings in may be
  overridden, as YAML merges mean.
- Anchors and aliases stay allowed, but the document they expand to may hold at most
  :data:`MAX_VALUES` values (scalars, lists and mappings, each alias counted as what it stands
  for), and an alias may not contain itself. A few aliases can name each other to stand for
  billions of values (a "billion laughs" bomb): PyYAML builds them as shared objects cheaply,
  but every later walk over the job would expand them. The count is made on the parsed node
  graph, each node once, before any Python object is built.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_VALUES = 100_000  # values a document may expand to; a job file holds hundreds
_MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlRefused(ValueError):
    """A YAML text that parses but is refused: a duplicate key, or aliases that expand too far."""


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """How many values ``root`` stands for with every alias expanded, counted up to ``limit + 1``.
    Raises YamlRefused where a collection contains itself."""
    size: dict[int, int] = {}
    open_ids: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in size:
            continue
        if isinstance(node, yaml.ScalarNode):
            size[key] = 1
            continue
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value))
        if children_done:
            open_ids.discard(key)
            size[key] = min(limit + 1, 1 + sum(size[id(c)] for c in children))
            continue
        if key in open_ids:
            raise YamlRefused(f"line {_line(node)}: an alias refers to a list or mapping that contains it "
                              "(a recursive alias); write the values out")
        open_ids.add(key)
        stack.append((node, True))
        for child in children:
            if id(child) in open_ids:
                raise YamlRefused(f"line {_line(child)}: an alias refers to a list or mapping that contains it "
                                  "(a recursive alias); write the values out")
            if id(child) not in size:
                stack.append((child, False))
    return size[id(root)]


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and documents whose aliases expand past MAX_VALUES."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, MAX_VALUES) > MAX_VALUES:
            raise YamlRefused(f"its anchors and aliases expand to more than {MAX_VALUES} values (an alias "
                              "bomb?); a job needs far fewer: write the values out, or use fewer aliases")
        return self.construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.get(key)
                except TypeError:  # an unhashable key: SafeLoader refuses it below
                    continue
                if seen is not None:
                    raise YamlRefused(f"duplicate key {key!r} at line {_line(key_node)} (first at line {seen}); "
                                      "give each key once")
                first[key] = _line(key_node)
        return super().construct_mapping(node, deep=deep)



def load_yaml(text: str) -> Any:
    """``text`` parsed as YAML; raises yaml.YAMLError for bad syntax, YamlRefused for a duplicate key or
    aliases that expand too far, RecursionError for nesting deeper than Python's recursion limit."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506  a SafeLoader subclass
