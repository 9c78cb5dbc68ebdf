"""The hook side of the ``Decoder``: TransformerLens's hook context with errors that name the hook,
``run_with_cache`` returning an ``ActivationCache``, and the layer of a hook name.

A mixin of ``workbench.model.Decoder``, placed before ``HookedRootModule`` in its bases so these
methods wrap TransformerLens's own.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Optional

from torch import Tensor
from transformer_lens import ActivationCache
from transformer_lens.hook_points import HookPoint

from workbench.errors import InputError


class HookMethods:
    """``hooks``, ``run_with_cache`` and ``layer_of`` for a ``HookedRootModule``."""

    @contextmanager
    def hooks(self, fwd_hooks=[], bwd_hooks=[], reset_hooks_end=True, clear_contexts=False):
        """TransformerLens's ``hooks`` context, with each hook's errors annotated by its hook point.

        Hooks are removed on exit even when a hook raises.
        """
        with super().hooks([(n, _annotate_errors(h)) for n, h in fwd_hooks],
                           [(n, _annotate_errors(h)) for n, h in bwd_hooks],
                           reset_hooks_end, clear_contexts) as model:
            yield model

    def run_with_cache(self, *model_args: Any, **kwargs: Any) -> tuple[Any, ActivationCache]:
        """Runs the model and caches activations (all, or those ``names_filter`` selects).

        Example:
            >>> logits, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))  # doctest: +SKIP
            >>> cache["pattern", 0].shape   # [batch, n_heads, query_pos, key_pos]           # doctest: +SKIP
        """
        out, cache_dict = super().run_with_cache(*model_args, **kwargs)
        return out, ActivationCache(cache_dict, self, has_batch_dim=not kwargs.get("remove_batch_dim", False))

    def layer_of(self, hook_name: str) -> Optional[int]:
        """The block a hook point belongs to (``blocks.3.attn.hook_z`` -> 3), None outside the blocks.

        Example:
            >>> model.layer_of("blocks.3.attn.hook_z"), model.layer_of("hook_embed")   # doctest: +SKIP
            (3, None)
        """
        if hook_name not in self.hook_dict:
            close = [name for name in self.hook_dict if name.split(".")[-1] == hook_name.split(".")[-1]][:3]
            raise InputError(f"no hook point named {hook_name!r} in this model"
                             + (f" (same last part: {close})" if close else ""))
        return self.hook_dict[hook_name].layer() if hook_name.startswith("blocks.") else None


def _annotate_errors(hook_fn: Callable) -> Callable:
    """Wraps a user hook so an exception it raises says which hook point it was on."""
    def wrapped(tensor: Tensor, hook: HookPoint) -> Any:
        try:
            return hook_fn(tensor, hook=hook)
        except Exception as error:
            error.add_note(f"raised by the hook {getattr(hook_fn, '__name__', hook_fn)!s} on '{hook.name}'")
            raise

    return wrapped
