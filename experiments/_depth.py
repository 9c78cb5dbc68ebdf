"""How far a forward pass must run for some hook points to fire: the one place that knows the final norm's hooks
lie after the blocks, where ``stop_at_layer=n_layers`` never reaches.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

_BLOCK = re.compile(r"^blocks\.(\d+)\.")
EMBEDDING_HOOKS = ("hook_embed", "hook_pos_embed", "hook_tokens")


def hook_layer(model, hook_name: str) -> int:
    """The block a hook point is in: -1 before the blocks (the embeddings), ``n_layers - 1`` after them (the final
    norm's hooks), for "which layer does this read" questions; a forward's depth is ``stop_at_layer_for``'s.

    Example:
        >>> hook_layer(model, "blocks.1.hook_resid_post"), hook_layer(model, "hook_embed")
        (1, -1)
    """
    match = _BLOCK.match(hook_name)
    if match:
        return int(match.group(1))
    return -1 if hook_name in EMBEDDING_HOOKS else model.cfg.n_layers - 1


def stop_at_layer_for(model, hook_names: Iterable[str]) -> Optional[int]:
    """The ``stop_at_layer`` that runs just far enough for every hook in ``hook_names`` to fire: the block after the
    deepest one (0 for embedding hooks only), or None when one lies after the blocks (``ln_final``'s hooks fire only
    in a full forward).

    Example:
        >>> stop_at_layer_for(model, ["blocks.0.hook_resid_post"]), stop_at_layer_for(model, ["hook_embed"])
        (1, 0)
        >>> stop_at_layer_for(model, ["blocks.0.hook_resid_post", "ln_final.hook_normalized"]) is None
        True
    """
    stop = 0
    for name in hook_names:
        match = _BLOCK.match(name)
        if match:
            stop = max(stop, int(match.group(1)) + 1)
        elif name not in EMBEDDING_HOOKS:
            return None
    return stop
