"""SAEs stored in other libraries' layouts (SAELens's conversion kinds), converted at the file boundary.

Each kind is one module holding a ``ForeignKind``: the files of a release's SAE folder it reads (``files``) and the
conversion of those local files into SAELens's config and tensors (``convert``). ``workbench.hub.sae_releases``
fetches the files and ``workbench.sae.files`` builds the checked ``SAE`` from what ``convert`` returns, so every kind
gets the same checks (config fields, tensor names, shapes, finiteness) as a SAELens directory. Nothing here runs
remote code or unpickles anything but through ``torch.load(weights_only=True)``, and nothing reaches the Hub but
through ``workbench.hub.sae_releases.fetch_files`` (``gemma_3`` asks for a ``config.json`` a folder may lack).

Modules:
- ``kinds``: ``ForeignKind`` and the checked readers the kinds share (bounded JSON, safetensors, ``.npz``, ``.pt``).
- ``state_dicts``: the named tensors a kind needs from a weights-only ``.pt`` state dict.
- ``deepseek_qwen``: ``deepseek_r1`` and ``qwen_scope`` (one ``.pt`` per SAE; the config from the names).
- ``goodfire``: ``goodfire`` (Goodfire's two Llama SAEs).
- ``hook_z``: ``connor_rob_hook_z`` (GPT-2 small attention-output SAEs reading ``hook_z``).
- ``sparsify``: ``sparsify`` (EleutherAI sparsify top-k folders; also read by ``wb.load_sae(repo, folder=...)``).
- ``gemma_scope``: ``gemma_2`` (Gemma Scope's ``params.npz``; sizes and hooks from the repo id and folder, embedding
  SAEs rescaled) and ``gemma_3`` (Gemma Scope 2's ``params.safetensors``, its ``config.json`` or the one SAELens
  infers; transcoders, affine ones with ``W_skip``).
- ``llama_scope``: ``llama_scope`` (one threshold, rescaled for the folded norm scaling) and ``llama_scope_r1_distill``.
- ``dictionary_learning``: ``dictionary_learning_1`` (``config.json`` + ``ae.pt``; standard, top-k, gated, JumpReLU).
- ``temporal``: ``temporal`` (canrager's temporal SAEs: ``conf.yaml`` + ``latest_ckpt.safetensors``).
- ``transcoders``: ``gemma_2_transcoder``, ``mwhanna_transcoder``, ``mntss_clt_layer_transcoder``.
"""

from __future__ import annotations

from workbench.errors import ConfigError
from workbench.sae.foreign import deepseek_qwen
from workbench.sae.foreign import goodfire
from workbench.sae.foreign import hook_z
from workbench.sae.foreign import sparsify
from workbench.sae.foreign import temporal
from workbench.sae.foreign import dictionary_learning
from workbench.sae.foreign import gemma_scope
from workbench.sae.foreign import llama_scope
from workbench.sae.foreign.kinds import ForeignKind
from workbench.sae.foreign.transcoders import TRANSCODER_KINDS

# Every kind loaded natively, by SAELens's name (its NAMED_PRETRAINED_SAE_LOADERS key). ``sae_lens`` itself is
# SAELens's own directory layout, read by ``workbench.sae.files`` directly.
KINDS: dict[str, ForeignKind] = {kind.name: kind for kind in (
    deepseek_qwen.DEEPSEEK_R1, deepseek_qwen.QWEN_SCOPE,
    goodfire.GOODFIRE,
    hook_z.CONNOR_ROB_HOOK_Z,
    sparsify.SPARSIFY,
    gemma_scope.GEMMA_2, gemma_scope.GEMMA_3,
    llama_scope.LLAMA_SCOPE, llama_scope.LLAMA_SCOPE_R1_DISTILL,
    dictionary_learning.DICTIONARY_LEARNING_1,
    temporal.TEMPORAL,
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
