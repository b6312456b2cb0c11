"""Reading config YAML (run, fine-tuning, model and ablation configs, ``key=value`` overrides) strictly.

``yaml.safe_load`` plus four refusals, each a one-line :class:`ConfigError` naming the source and line:

* a key written twice in one mapping (YAML keeps the last silently: a run with the value the user did not
  mean); merged keys (``<<: *base``) may still be overridden;
* aliases whose expansion adds more than :data:`MAX_ALIAS_VALUES` values to those written (an "alias bomb": a
  few hundred bytes that expand to billions of values and hang whatever walks or prints them), or an alias
  inside itself; values written out are never counted against it (a 50,000-name ``data.labels`` list is fine);
* values nested more than :data:`MAX_DEPTH` levels deep (or too deep for PyYAML's recursive reader);
* a syntax error, reported as ``<source>, line N: <problem>`` instead of PyYAML's multi-line snippet.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from distaff.train.core.errors import ConfigError

MAX_ALIAS_VALUES = 10_000   # values (scalars and collections) a config's aliases may add when expanded
MAX_DEPTH = 64              # levels of nesting: the deepest config section is a handful
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    source = ""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue
            key, line = self.construct_object(key_node), key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"{self.source}, line {line}: key {key!r} is written twice in one mapping (first "
                                  f"on line {seen[key]}); YAML would keep the last silently: keep one")
            seen[key] = line
        return super().construct_mapping(node, deep)


def _expanded_size(node: Node, sizes: dict[int, int], open_nodes: set[int], source: str, limit: int) -> int:
    """The number of values ``node`` stands for with every alias expanded, saturating above ``limit``; a value
    nested more than :data:`MAX_DEPTH` levels deep is refused."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise ConfigError(f"{source}, line {node.start_mark.line + 1}: a YAML alias refers to the value it is part "
                          "of (an endless value); write the values out")
    if len(open_nodes) >= MAX_DEPTH:
        raise ConfigError(f"{source}, line {node.start_mark.line + 1}: values nested more than {MAX_DEPTH} levels "
                          "deep; no config needs that many: flatten it")
    open_nodes.add(key)
    size = 1
    for child in _children(node):
        size = min(size + _expanded_size(child, sizes, open_nodes, source, limit), limit + 1)
    open_nodes.discard(key)
    sizes[key] = size
    return size


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return node.value
    if isinstance(node, MappingNode):
        return [child for pair in node.value for child in pair]
    return []


def _written_size(root: Node) -> int:
    """The number of distinct values written (an alias is the node it names, so it adds nothing)."""
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if id(node) not in seen:
            seen.add(id(node))
            todo.extend(_children(node))
    return len(seen)


def _one_line(err: yaml.YAMLError, source: str) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else source
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    return f"{where}: not valid YAML: {problem}{f' ({context})' if context else ''}"


def load_yaml(text: str, source: str) -> Any:
    """The value of the YAML document ``text`` (``source`` names it in errors: a file, ``override KEY``)."""
    loader = _StrictLoader(text)
    loader.source = source
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        written = _written_size(node)
        if _expanded_size(node, {}, set(), source, written + MAX_ALIAS_VALUES) > written + MAX_ALIAS_VALUES:
            raise ConfigError(f"{source}: its YAML aliases add more than {MAX_ALIAS_VALUES:,} values (an alias bomb?); "
                              "write the values out")
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        raise ConfigError(_one_line(err, source)) from None
    except RecursionError:      # PyYAML's composer recurses once per level before any check of ours runs
        raise ConfigError(f"{source}: values nested too deeply for the YAML reader; no config needs that many "
                          "levels: flatten it") from None
    finally:
        loader.dispose()
