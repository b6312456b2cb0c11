"""Reading config YAML (run, fine-tuning, model and ablation configs, ``key=value`` overrides) strictly.

``yaml.safe_load`` plus three refusals, each a one-line :class:`ConfigError` naming the source and line:

* a key written twice in one mapping (YAML keeps the last silently: a run with the value the user did not
  mean); merged keys (``<<: *base``) may still be overridden;
* aliases that expand to more than :data:`MAX_VALUES` values (an "alias bomb": a few hundred bytes that
  expand to billions of values and hang whatever walks or prints them), or an alias inside itself;
* a syntax error, reported as ``<source>, line N: <problem>`` instead of PyYAML's multi-line snippet.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from distaff.train.core.errors import ConfigError

MAX_VALUES = 10_000     # values (scalars and collections) a config may hold once its aliases are expanded
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


def _expanded_size(node: Node, sizes: dict[int, int], open_nodes: set[int], source: str) -> int:
    """The number of values ``node`` stands for with every alias expanded, saturating above MAX_VALUES."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise ConfigError(f"{source}, line {node.start_mark.line + 1}: a YAML alias refers to the value it is part "
                          "of (an endless value); write the values out")
    open_nodes.add(key)
    if isinstance(node, SequenceNode):
        children = node.value
    elif isinstance(node, MappingNode):
        children = [child for pair in node.value for child in pair]
    else:
        children = []
    size = 1
    for child in children:
        size = min(size + _expanded_size(child, sizes, open_nodes, source), MAX_VALUES + 1)
    open_nodes.discard(key)
    sizes[key] = size
    return size


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
        if _expanded_size(node, {}, set(), source) > MAX_VALUES:
            raise ConfigError(f"{source}: its YAML aliases expand to more than {MAX_VALUES:,} values (an alias bomb?); "
                              "write the values out")
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        raise ConfigError(_one_line(err, source)) from None
    finally:
        loader.dispose()
