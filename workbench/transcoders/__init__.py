"""Transcoders for attribution graphs: ``TranscoderSet`` and ``load_transcoders``.

- ``hooks``: circuit-tracer's hook spellings (``mlp.hook_in``, ``mlp.hook_out``, ...) onto ours;
- ``set``: ``TranscoderSet``, per-layer or cross-layer transcoders in one representation, and its own format;
- ``layout``: the layers as ``wb.SAE`` transcoders in SAELens's layout, and the one converter from circuit-tracer's;
- ``format``: our own format's writer;
- ``yaml_config``: circuit-tracer's ``config.yaml`` read with sizes and aliases bounded;
- ``files``: ``load_transcoders`` (circuit-tracer's per-layer and cross-layer formats, SAELens transcoders, ours).

The attribution itself is ``experiments.attribution``.
"""

from workbench.transcoders.files import load_transcoders
from workbench.transcoders.set import TranscoderSet

__all__ = ["TranscoderSet", "load_transcoders"]
