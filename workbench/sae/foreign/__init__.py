"""SAEs stored in other libraries' layouts (SAELens's conversion kinds), converted at the file boundary.

Each kind is one module holding a ``ForeignKind``: the files of a release's SAE folder it reads (``files``) and the
conversion of those local files into SAELens's config and tensors (``convert``). ``workbench.hub.sae_releases``
fetches the files and ``workbench.sae.files`` builds the checked ``SAE`` from what ``convert`` returns, so every kind
gets the same checks (config fields, tensor names, shapes, finiteness) as a SAELens directory. Nothing here reaches
the Hub, runs remote code or unpickles anything but through ``torch.load(weights_only=True)``.

Modules:
- ``kinds``: ``ForeignKind`` and the checked readers the kinds share (bounded JSON, safetensors, ``.npz``, ``.pt``).
- ``transcoders``: ``gemma_2_transcoder``, ``mwhanna_transcoder``, ``mntss_clt_layer_transcoder``.
"""

from __future__ import annotations

from workbench.errors import ConfigError
from workbench.sae.foreign.kinds import ForeignKind
from workbench.sae.foreign.transcoders import TRANSCODER_KINDS

# Every kind loaded natively, by SAELens's name (its NAMED_PRETRAINED_SAE_LOADERS key). ``sae_lens`` itself is
# SAELens's own directory layout, read by ``workbench.sae.files`` directly.
KINDS: dict[str, ForeignKind] = {kind.name: kind for kind in (
    *TRANSCODER_KINDS,
)}


def foreign_kind(name: str) -> ForeignKind:
    """The loader of SAELens conversion kind ``name``; a kind not loaded here is a ``ConfigError`` naming it.

    Example:
        >>> foreign_kind("no_such_kind")
        Traceback (most recent call last):
        workbench.errors.ConfigError: SAELens's 'no_such_kind' form is not loaded yet (loaded: 'sae_lens'...)
    """
    if name not in KINDS:
        loaded = ", ".join(repr(kind) for kind in ("sae_lens", *sorted(KINDS)))
        raise ConfigError(f"SAELens's {name!r} form is not loaded yet (loaded: {loaded})")
    return KINDS[name]


__all__ = ["ForeignKind", "KINDS", "foreign_kind"]
