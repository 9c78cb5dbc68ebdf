"""``DecoderHost``: what the ``Decoder``'s mixins and helper modules rely on, declared once.

The hook, token and weight methods live in mixins (``hooking``, ``tokens_api``, ``weights_api``) and the
model's larger jobs in their own modules (``cache_batches``, ``cache_store``, ``generation``, ``saving``,
``processing``). They are typed against this Protocol instead of importing ``workbench.model`` back, so no
module below the model depends on it and a type checker sees every attribute they use. ``Decoder``
satisfies it (``tests/unit/test_layering.py`` checks each declared name exists on a real model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol

from torch import Tensor, nn

if TYPE_CHECKING:
    from workbench.config import ModelConfig
    from workbench.hook_point import HookPoint
    from workbench.options import ConfigView, RuntimeOptions
    from workbench.tokenizer import Tokenizer


class DecoderHost(Protocol):
    """The attributes and methods of a ``Decoder`` that code outside ``workbench.model`` may use.

    Example:
        >>> from workbench.host import HOST_NAMES
        >>> all(hasattr(model, name) for name in HOST_NAMES)
        True
    """

    config: "ModelConfig"
    options: "RuntimeOptions"
    tokenizer: Optional["Tokenizer"]
    hook_dict: dict[str, "HookPoint"]
    hook_aliases: dict[str, str]
    mod_dict: dict[str, Any]
    blocks: nn.ModuleList
    embed: nn.Module
    pos_embed: Optional[nn.Module]
    ln_final: Optional[nn.Module]
    unembed: nn.Module
    training: bool

    @property
    def cfg(self) -> "ConfigView": ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

    def hooks(self, fwd_hooks: Any = ..., bwd_hooks: Any = ..., reset_hooks_end: bool = ...,
              clear_contexts: bool = ...) -> Any: ...

    def run_with_cache(self, *args: Any, **kwargs: Any) -> Any: ...

    def cached_names(self, names_filter: Any = None) -> Any: ...

    def check_hook_names(self, names: Any) -> None: ...

    def as_tokens(self, input: Any, prepend_bos: Optional[bool] = None) -> Tensor: ...

    def as_tokens_and_mask(self, input: Any, *args: Any, **kwargs: Any) -> tuple[Tensor, Optional[Tensor]]: ...

    def to_tokens(self, input: Any, *args: Any, **kwargs: Any) -> Tensor: ...

    def to_string(self, tokens: Any) -> Any: ...

    def apply_final_norm(self, resid: Tensor, frozen_scale: Optional[Tensor] = None) -> Tensor: ...


# The names the Protocol declares (checked against a real Decoder by the layering test).
HOST_NAMES = tuple(name for name in {**DecoderHost.__annotations__, **vars(DecoderHost)}
                   if not name.startswith("_") or name == "__call__")
