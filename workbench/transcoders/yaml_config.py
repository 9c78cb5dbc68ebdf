"""Reading circuit-tracer's ``config.yaml`` safely: bounded size, aliases expanded no further than the data.

``yaml.safe_load`` expands every alias: a few hundred bytes of nested anchors (the "billion laughs") expand to
billions of nodes, and a recursive alias to a structure no JSON-like walk ends on. The document is composed first
(aliases stay references to one node), and its expanded size counted without expanding it; a document that
expands to more nodes than ``EXPANSION`` times the nodes it writes, or refers to itself, is refused before
``safe_load`` builds anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from workbench.errors import CheckpointError, ConfigError

MAX_BYTES = 1 << 20  # a transcoder set's config is a few hundred bytes; a megabyte is no config
EXPANSION = 4  # an alias may repeat what the document writes, a few times over, not more


def read_config(path: Path) -> Any:
    """The YAML document at ``path``, after the size and alias checks (``CheckpointError`` naming the file).

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "config.yaml"
        >>> _ = path.write_text("a: &x [1, 2]\\nb: *x\\n"); read_config(path)
        {'a': [1, 2], 'b': [1, 2]}
        >>> _ = path.write_text("a: &a [1, 1]\\nb: &b [*a, *a]\\nc: &c [*b, *b]\\nd: [*c, *c, *c, *c]\\n")
        >>> read_config(path)
        Traceback (most recent call last):
        workbench.errors.CheckpointError: ...: its aliases expand to 91 nodes, more than 4 x the 11 it writes; refusing to expand them
    """
    try:
        if path.stat().st_size > MAX_BYTES:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes, more than a config's {MAX_BYTES}")
        text = path.read_text()
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as error:
        raise CheckpointError(f"{path}: not a readable YAML file ({type(error).__name__}: {error})"[:400]) from None
    if root is None:
        return None
    written, expanded = _sizes(root, path)
    if expanded > EXPANSION * written:
        raise CheckpointError(f"{path}: its aliases expand to {expanded} nodes, more than {EXPANSION} x the {written} "
                              "it writes; refusing to expand them")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not a readable YAML file ({error})") from None


def _sizes(root: yaml.Node, path: Path) -> tuple[int, int]:
    """(distinct nodes, nodes once every alias is expanded), walking each distinct node once (no recursion)."""
    expanded: dict[int, int] = {}
    order, stack, on_path = [], [(root, False)], set()
    while stack:
        node, done = stack.pop()
        if done:
            on_path.discard(id(node))
            expanded[id(node)] = 1 + sum(expanded[id(child)] for child in _children(node))
            order.append(node)
            continue
        if id(node) in expanded:
            continue
        if id(node) in on_path:
            raise CheckpointError(f"{path}: an alias refers to the node that holds it (a recursive structure); "
                                  "refusing it")
        on_path.add(id(node))
        stack.append((node, True))
        for child in _children(node):
            if id(child) in on_path:
                raise CheckpointError(f"{path}: an alias refers to the node that holds it (a recursive structure); "
                                      "refusing it")
            if id(child) not in expanded:
                stack.append((child, False))
    return len(expanded), expanded[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []
