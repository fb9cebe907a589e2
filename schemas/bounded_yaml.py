"""YAML that operators and CI write (settings, keyring, schedules, scenarios), read with a
bound on what it expands to.

``yaml.safe_load`` builds an alias (``*a``) as a second reference to the anchored value, so
a file of a few hundred bytes whose anchors each repeat the previous one nine times
("billion laughs") loads at once as a graph that is 9**9 nodes when walked. Everything
after the load walks it: pydantic's validation, its error messages, a repr. So the node
graph is measured before anything is built from it: the number of nodes it has with every
alias expanded, and a cycle (``&a [*a]``) is refused outright. Anchors a person writes to
share a block stay usable: only the expanded size counts.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_EXPANDED_NODES", "YamlTooLarge", "load_yaml"]

MAX_EXPANDED_NODES = 1_000_000
"""Nodes (scalars, lists, mappings) a document may hold with its aliases expanded; a
keyring of 10,000 keys has about 200,000."""


class YamlTooLarge(ValueError):
    """The document expands past ``MAX_EXPANDED_NODES``, refers to itself, or nests past
    the parser's recursion limit."""


def load_yaml(text: str, max_nodes: int = MAX_EXPANDED_NODES) -> Any:
    """``yaml.safe_load(text)`` for a document within ``max_nodes`` once expanded;
    ``YamlTooLarge`` otherwise (``yaml.YAMLError`` for text that is no YAML)."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expanded(node, max_nodes)
        return loader.construct_document(node)
    except RecursionError:
        raise YamlTooLarge("YAML nested too deep") from None
    finally:
        loader.dispose()


def _children(node: Any) -> list[Any]:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expanded(root: Any, max_nodes: int) -> None:
    """Post-order walk of the composed graph (an alias is the anchored node object itself),
    each node's expanded size computed once from its children's."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            total = 1
            for child in _children(node):
                total += sizes[id(child)]
                if total > max_nodes:
                    raise YamlTooLarge(
                        f"YAML expands to more than {max_nodes} nodes through its aliases"
                    )
            sizes[key] = total
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise YamlTooLarge("YAML alias refers to a node that contains it")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
