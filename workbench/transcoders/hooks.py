"""Where a transcoder reads and writes, in our hook names.

circuit-tracer's configs name the points TransformerLens-style, relative to a block: ``mlp.hook_in`` (the MLP's
input, i.e. the second norm's output, gain included), ``mlp.hook_out`` (the MLP's output), ``hook_resid_mid``,
``hook_mlp_out``. Our ``ln2.hook_normalized`` is after the gain, so it is exactly the MLP's input; ``hook_mlp_out``
is the MLP's output on a model without a norm after the MLP. A name we have already (``ln2.hook_normalized``) is
taken as it is. The table below is the only place the spellings meet.
"""

from __future__ import annotations

import re

from workbench.errors import ConfigError

# circuit-tracer's spelling -> ours (relative to ``blocks.{layer}.``).
SPELLINGS = {"mlp.hook_in": "ln2.hook_normalized", "mlp.hook_out": "hook_mlp_out"}
_BLOCK_PREFIX = re.compile(r"^blocks\.(\d+)\.(.+)$")


def block_hook(spelling: object, field: str) -> str:
    """Our block-relative hook name for ``spelling`` (circuit-tracer's or ours); ``field`` names it in errors.

    Example:
        >>> block_hook("mlp.hook_in", "feature_input_hook"), block_hook("hook_resid_mid", "feature_input_hook")
        ('ln2.hook_normalized', 'hook_resid_mid')
        >>> block_hook("blocks.2.mlp.hook_out", "feature_output_hook")
        Traceback (most recent call last):
        workbench.errors.ConfigError: feature_output_hook must name a hook inside a block without 'blocks.{layer}.' (e.g. 'mlp.hook_in', 'hook_resid_mid'), got 'blocks.2.mlp.hook_out'
    """
    if not isinstance(spelling, str) or not spelling or _BLOCK_PREFIX.match(spelling):
        raise ConfigError(f"{field} must name a hook inside a block without 'blocks.{{layer}}.' (e.g. 'mlp.hook_in', "
                          f"'hook_resid_mid'), got {spelling!r}")
    return SPELLINGS.get(spelling, spelling)


def split_block_hook(name: object, field: str) -> tuple[int, str]:
    """``(layer, block-relative name)`` of a full hook name such as SAELens's ``blocks.3.ln2.hook_normalized``.

    Example:
        >>> split_block_hook("blocks.3.hook_mlp_out", "hook_name_out")
        (3, 'hook_mlp_out')
    """
    match = _BLOCK_PREFIX.match(name) if isinstance(name, str) else None
    if match is None:
        raise ConfigError(f"{field} must be a block's hook ('blocks.{{layer}}.<name>') for a transcoder, got {name!r}")
    return int(match.group(1)), match.group(2)
