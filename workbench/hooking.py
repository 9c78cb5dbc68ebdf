"""The hook side of the ``Decoder``: TransformerLens's hook context with errors that name the hook,
``run_with_cache`` returning an ``ActivationCache``, and the layer of a hook name.

A mixin of ``workbench.model.Decoder``, placed before ``HookedRootModule`` in its bases so these
methods wrap TransformerLens's own. What it adds to TransformerLens's behaviour:

- a hook name that is not a hook point of the model (``run_with_hooks``/``hooks``, forward or
  backward, ``add_hook`` with a string, ``run_with_cache(names_filter=...)`` as a string or a
  list) is an ``InputError`` naming it and the nearest real names, instead of a bare ``KeyError``
  or a silently empty cache. Callable names and filters are left as they are.
- a hook that raises gets a note naming its hook point; a hook that returns a tensor of another
  shape, dtype or device than it received is an ``InputError`` naming the hook point and both. Hooks are
  removed after any error (TransformerLens's context manager does this).
- ``run_with_cache(batch_size=..., cache_dir=...)`` runs a dataset in batches in bounded memory,
  to memory or to disk (``workbench.cache_batches``).

The per-call cost is one Python call and a shape/dtype comparison per hook; names are checked
once, when hooks are added. Caching of every kind goes through ``workbench.hook_point``'s one cacher.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import Tensor
from transformer_lens import ActivationCache
from transformer_lens.hook_points import HookPoint

from workbench.cache_batches import run_with_cache_in_batches
from workbench.call_lock import model_lock
from workbench.errors import InputError
from workbench.hook_point import caching, caching_hooks, nearest_hook_names
from workbench.host import DecoderHost


# Typed against the host it is mixed into (workbench.host.DecoderHost); at run time a plain base.
_Host = DecoderHost if TYPE_CHECKING else object


class HookMethods(_Host):
    """``hooks``, ``add_hook``, ``attached_hooks``, ``run_with_cache``, ``get_caching_hooks`` and ``layer_of`` for a
    ``HookedRootModule``."""

    @contextmanager
    def hooks(self, fwd_hooks=[], bwd_hooks=[], reset_hooks_end=True, clear_contexts=False):
        """TransformerLens's ``hooks`` context, with hook names checked and each hook checked
        (its errors name the hook point; its result must keep the shape and dtype it received).

        Hooks are removed on exit even when a hook raises.

        Example:
            >>> with model.hooks(fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: z * 0)]):   # doctest: +SKIP
            ...     loss = model(tokens, return_type="loss")
        """
        fwd_hooks = self._checked_hook_list(fwd_hooks, "fwd_hooks")
        bwd_hooks = self._checked_hook_list(bwd_hooks, "bwd_hooks")
        # The model's lock for the whole block: another thread's call waits instead of running under these hooks.
        with model_lock(self), super().hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts) as model:
            yield model

    def remove_all_hook_fns(self, direction="both", including_permanent=False, level=None) -> None:
        """TransformerLens's, visiting only the hook points that hold a hook: the same hooks go, and an empty
        point is left alone instead of having its empty lists reassigned (an nn.Module ``__setattr__`` each:
        ~4 ms per ``hooks()`` exit on a 30-layer model, paid per layer by a batched sweep).

        Example:
            >>> model.add_hook("blocks.0.hook_resid_pre", lambda x, hook: x)
            >>> model.remove_all_hook_fns(); model.attached_hooks()
            {}
        """
        for point in self.hook_points():
            if point.fwd_hooks or point.bwd_hooks:
                point.remove_hooks(direction, including_permanent=including_permanent, level=level)

    def clear_contexts(self) -> None:
        """TransformerLens's, clearing only the hook points whose context holds something (as above, an empty
        one is left alone).

        Example:
            >>> model.hook_dict["blocks.0.hook_resid_pre"].ctx["seen"] = 1
            >>> model.clear_contexts(); model.hook_dict["blocks.0.hook_resid_pre"].ctx
            {}
        """
        for point in self.hook_points():
            if point.ctx:
                point.clear_context()

    def attached_hooks(self) -> dict[str, int]:
        """How many hooks (and cache sinks) are attached now, per hook point (only points with at least one).

        An empty dict after a run means nothing was left behind: the dashboard's Home page shows the
        total, and tests check it after a hook raises.

        Example:
            >>> model.attached_hooks()   # doctest: +SKIP
            {}
            >>> model.add_hook("blocks.0.hook_resid_pre", lambda x, hook: x); model.attached_hooks()   # doctest: +SKIP
            {'blocks.0.hook_resid_pre': 1}
        """
        counts = {name: len(point.fwd_hooks) + len(point.bwd_hooks) + (point.cache_into is not None)
                  for name, point in self.hook_dict.items()}
        return {name: n for name, n in counts.items() if n}

    def add_hook(self, name, hook, dir="fwd", is_permanent=False, level=None, prepend=False) -> None:
        """TransformerLens's ``add_hook`` (the hook stays until ``reset_hooks``), with a string name
        checked and the hook checked as in ``hooks``.

        Example:
            >>> model.add_hook("blocks.1.hook_resid_pre", lambda g, hook: print(g.norm()), dir="bwd")   # doctest: +SKIP
        """
        if isinstance(name, str):
            self.check_hook_names([name])
        elif not callable(name):
            raise InputError(f"a hook's name must be a hook point name or a function of the name, got {name!r}")
        if not callable(hook):
            raise InputError(f"the hook for {name!r} must be a function (tensor, hook) -> tensor or None, got {hook!r}")
        with model_lock(self):  # never attached in the middle of another thread's call
            super().add_hook(name, _checked_hook(hook, dir), dir=dir, is_permanent=is_permanent, level=level,
                             prepend=prepend)

    def run_with_cache(self, *model_args: Any, batch_size: Optional[int] = None, cache_dir: Any = None,
                       progress: bool = True, names_filter: Any = None, device: Any = None,
                       remove_batch_dim: bool = False, incl_bwd: bool = False, reset_hooks_end: bool = True,
                       clear_contexts: bool = False, pos_slice: Any = None,
                       **kwargs: Any) -> tuple[Any, ActivationCache]:
        """Runs the model and caches activations (all, or those ``names_filter`` selects).

        ``names_filter``: None (all), a hook name, a list of hook names (each must exist:
        ``InputError`` otherwise) or a function of the name. TransformerLens's options (``device``,
        ``remove_batch_dim``, ``incl_bwd``, ``reset_hooks_end``, ``clear_contexts``, ``pos_slice``)
        and the model's forward arguments (``attention_mask``, ``return_type``, ...) pass through.

        Over a dataset in bounded memory (``workbench.cache_batches``): ``batch_size=N`` runs the
        rows N at a time and joins each batch's activations on ``device`` (default: the model's);
        ``cache_dir=path`` (a new or empty directory) instead writes them there as safetensors
        shards and returns a cache that reads a hook from disk only when it is asked for (reopen it
        with ``wb.load_cache``). ``progress``: a tqdm bar over the batches. A ``CacheTooLargeError``
        after the first batch when the whole would not fit in memory; after any error nothing the
        call wrote is left and no hook stays attached.

        Every path caches through ``workbench.hook_point``'s one cacher: each selected point stores its
        output, detached, after any attached hooks ran (so the cache holds what they returned).

        Example:
            >>> logits, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
            >>> cache["pattern", 0].shape == (1, model.cfg.n_heads, tokens.shape[1], tokens.shape[1])
            True
            >>> _, last = model.run_with_cache(tokens, names_filter="blocks.0.hook_resid_post", pos_slice=-1)
            >>> last["blocks.0.hook_resid_post"].shape == (1, 1, model.cfg.d_model)   # the last position
            True
        """
        with model_lock(self):  # the whole call: no other thread's forward lands in this cache
            options = dict(names_filter=names_filter, device=device, pos_slice=pos_slice)
            if batch_size is not None or cache_dir is not None:
                if not model_args and "input" in kwargs:
                    model_args = (kwargs.pop("input"),)
                if not 1 <= len(model_args) <= 2:
                    raise InputError("run_with_cache with batch_size or cache_dir takes the input and at most "
                                     f"return_type as positional arguments, got {len(model_args)}")
                return run_with_cache_in_batches(self, *model_args, batch_size=batch_size, cache_dir=cache_dir,
                                                 progress=progress, remove_batch_dim=remove_batch_dim,
                                                 incl_bwd=incl_bwd, reset_hooks_end=reset_hooks_end,
                                                 clear_contexts=clear_contexts, **options, **kwargs)
            if remove_batch_dim and model_args and isinstance(model_args[0], Tensor) and model_args[0].ndim > 1 \
                    and model_args[0].shape[0] != 1:
                raise InputError(f"remove_batch_dim=True needs a batch of one row, got {model_args[0].shape[0]}")
            is_cached = self.cached_names(options.pop("names_filter"))
            cache: dict[str, Tensor] = {}
            if incl_bwd or not reset_hooks_end:  # the cacher must outlive this call: as hooks
                fwd, bwd = caching_hooks(self.hook_dict, is_cached, cache, incl_bwd=incl_bwd,
                                         remove_batch_dim=remove_batch_dim, **options)
                with self.hooks(fwd_hooks=_trusted(fwd), bwd_hooks=_trusted(bwd), reset_hooks_end=reset_hooks_end,
                                clear_contexts=clear_contexts):
                    out = self(*model_args, **kwargs)
                    if incl_bwd:
                        out.backward()
            else:
                with caching(self.hook_dict, is_cached, cache, remove_batch_dim=remove_batch_dim,
                             clear_contexts=clear_contexts, **options):
                    out = self(*model_args, **kwargs)
            return out, ActivationCache(cache, self, has_batch_dim=not remove_batch_dim)

    def cached_names(self, names_filter: Any = None) -> Callable[[str], bool]:
        """``names_filter`` (None, a hook name, a list of hook names or a function of the name) as a function
        of the name, as TransformerLens reads it, a string or list checked against the model's hook points.
        None is every hook that fires without an opt-in: ``attn.hook_result`` only with
        ``model.set_use_attn_result(True)``, ``hook_mlp_in`` only with ``model.set_use_hook_mlp_in(True)``, as
        TransformerLens (a filter or list that names either caches it).

        Example:
            >>> is_cached = model.cached_names(None)
            >>> is_cached("blocks.0.attn.hook_z"), is_cached("blocks.0.attn.hook_result")
            (True, False)
        """
        names_filter = self._checked_names_filter(names_filter)
        if isinstance(names_filter, str):
            return names_filter.__eq__
        if isinstance(names_filter, list):
            return set(names_filter).__contains__
        # None and functions see each point once, under its own name (an alias is cached when named).
        aliases = self.hook_aliases
        if names_filter is None:
            opted_out = tuple(suffix for suffix, opted_in in (("attn.hook_result", self.cfg.use_attn_result),
                                                              (".hook_mlp_in", self.cfg.use_hook_mlp_in)) if not opted_in)
            return lambda name: name not in aliases and not name.endswith(opted_out)
        if callable(names_filter):
            return lambda name: name not in aliases and names_filter(name)
        raise InputError(f"names_filter must be None, a hook name, a list of hook names or a function of the name, "
                         f"got {names_filter!r}")

    def get_caching_hooks(self, names_filter: Any = None, incl_bwd: bool = False, device: Any = None,
                          remove_batch_dim: bool = False, cache: Optional[dict] = None, pos_slice: Any = None):
        """TransformerLens's ``get_caching_hooks``: (cache, forward hooks, backward hooks) that store what
        ``run_with_cache`` would (``workbench.hook_point.caching_hooks``), ``names_filter`` as in
        ``cached_names``. The caching hooks skip the per-hook check user hooks get.

        Example:
            >>> cache, fwd, bwd = model.get_caching_hooks(["blocks.0.attn.hook_z"])
            >>> with model.hooks(fwd_hooks=fwd):
            ...     _ = model(tokens)
            >>> list(cache)
            ['blocks.0.attn.hook_z']
        """
        cache = {} if cache is None else cache
        fwd, bwd = caching_hooks(self.hook_dict, self.cached_names(names_filter), cache, incl_bwd=incl_bwd,
                                 device=device, remove_batch_dim=remove_batch_dim, pos_slice=pos_slice)
        self.is_caching = True
        return cache, _trusted(fwd), _trusted(bwd)

    def add_caching_hooks(self, names_filter: Any = None, incl_bwd: bool = False, device: Any = None,
                          remove_batch_dim: bool = False, cache: Optional[dict] = None) -> dict:
        """TransformerLens's ``add_caching_hooks``: the hooks of ``get_caching_hooks`` attached until
        ``reset_hooks``; returns the cache they fill.

        Example:
            >>> cache = model.add_caching_hooks("blocks.0.attn.hook_z"); _ = model(tokens); model.reset_hooks()
            >>> list(cache), model.attached_hooks()
            (['blocks.0.attn.hook_z'], {})
        """
        cache, fwd, bwd = self.get_caching_hooks(names_filter, incl_bwd, device, remove_batch_dim, cache)
        for direction, pairs in (("fwd", fwd), ("bwd", bwd)):
            for name, hook in pairs:
                super().add_hook(name, hook, dir=direction)
        return cache

    def check_hook_names(self, names) -> None:
        """``InputError`` naming each of ``names`` that is not a hook point, with the nearest real names.

        Example:
            >>> model.check_hook_names(["blocks.0.attn.hook_zz"])   # doctest: +SKIP
            InputError: no hook point named 'blocks.0.attn.hook_zz' in this model (did you mean 'blocks.0.attn.hook_z', ...?)
        """
        unknown = [name for name in names if not (isinstance(name, str) and (name in self.hook_dict
                                                                           or name in self.hook_aliases))]
        if not unknown:
            return
        problems = []
        for name in unknown:
            if not isinstance(name, str):
                problems.append(f"{name!r} is not a hook name (a string)")
                continue
            close = nearest_hook_names(name, [*self.hook_dict, *self.hook_aliases])
            problems.append(f"no hook point named {name!r} in this model"
                            + (f" (did you mean {', '.join(map(repr, close))}?)" if close else ""))
        raise InputError("; ".join(problems) + f". model.hook_dict lists its {len(self.hook_dict)} hook points.")

    def layer_of(self, hook_name: str) -> Optional[int]:
        """The block a hook point belongs to (``blocks.3.attn.hook_z`` -> 3), None outside the blocks.

        Example:
            >>> model.layer_of("blocks.3.attn.hook_z"), model.layer_of("hook_embed")   # doctest: +SKIP
            (3, None)
        """
        self.check_hook_names([hook_name])
        return self.mod_dict[hook_name].layer() if hook_name.startswith("blocks.") else None

    # ---- helpers --------------------------------------------------------------------------------
    def _checked_hook_list(self, hooks: Any, argument: str) -> list[tuple[Any, Callable]]:
        """``hooks`` as a list of (name, checked hook), every string name a hook point of the model."""
        if isinstance(hooks, tuple) and len(hooks) == 2 and isinstance(hooks[0], str) and callable(hooks[1]):
            raise InputError(f"{argument} is a list of (name, hook) pairs: wrap the single pair in a list, "
                             f"{argument}=[({hooks[0]!r}, ...)]")
        pairs = list(hooks)
        for pair in pairs:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise InputError(f"each entry of {argument} must be a (name, hook) pair, got {pair!r}")
            name, hook = pair
            if not (isinstance(name, str) or callable(name)):
                raise InputError(f"a hook's name in {argument} must be a hook point name or a function of the "
                                 f"name, got {name!r}")
            if not callable(hook):
                raise InputError(f"the hook for {name!r} in {argument} must be a function (tensor, hook) -> tensor "
                                 f"or None, got {hook!r}")
        self.check_hook_names([name for name, _ in pairs if isinstance(name, str)])
        direction = "bwd" if argument == "bwd_hooks" else "fwd"
        return [(name, hook if isinstance(hook, _Trusted) else _checked_hook(hook, direction)) for name, hook in pairs]

    def _checked_names_filter(self, names_filter: Any) -> Any:
        """A string or list ``names_filter`` checked (a tuple or set becomes a list); others unchanged."""
        if isinstance(names_filter, str):
            self.check_hook_names([names_filter])
        elif isinstance(names_filter, (list, tuple, set, frozenset)):
            names_filter = list(names_filter)
            self.check_hook_names(names_filter)
        return names_filter



class _Trusted(partial):
    """A hook of our own (TransformerLens's caching hooks), which ``hooks`` attaches unwrapped."""


def _trusted(pairs: list) -> list:
    return [(name, _Trusted(hook)) for name, hook in pairs]


def _hook_label(hook_fn: Callable) -> str:
    """A short name for a hook in messages (a partial's repr can be huge: it shows its arguments)."""
    if isinstance(hook_fn, partial):
        return f"partial({_hook_label(hook_fn.func)}, ...)"
    return getattr(hook_fn, "__qualname__", None) or getattr(hook_fn, "__name__", None) or type(hook_fn).__name__


def _checked_hook(hook_fn: Callable, dir: str = "fwd") -> Callable:
    """Wraps a user hook: an exception it raises gets a note naming its hook point, and a result
    of another shape or dtype than the tensor it received is an ``InputError`` naming both.

    ``dir``: "bwd" accepts a one-element tuple ``(grad,)`` (what PyTorch's backward hooks return);
    a forward hook returning any tuple is refused, since the next module would receive it.

    Example:
        >>> model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: (x,))])
        Traceback (most recent call last):
        workbench.errors.InputError: the hook <lambda> on 'blocks.0.hook_resid_pre' returned a tuple: ...
    """
    def checked(tensor: Tensor, hook: HookPoint) -> Any:
        try:
            result = hook_fn(tensor, hook=hook)
        except Exception as error:
            error.add_note(f"raised by the hook {_hook_label(hook_fn)} on '{hook.name}'")
            raise
        if result is None or result is tensor:
            return result
        backward_tuple = dir == "bwd" and isinstance(result, tuple) and len(result) == 1  # a bwd hook's (grad,)
        returned = result[0] if backward_tuple else result
        if not isinstance(returned, Tensor):
            raise InputError(f"the hook {_hook_label(hook_fn)} on '{hook.name}' returned a {type(result).__name__}: "
                             "a hook returns a tensor of the shape and dtype it received, or None")
        if returned.device != tensor.device:  # across a device map, the next module would run on the wrong device
            raise InputError(f"the hook {_hook_label(hook_fn)} on '{hook.name}' returned a tensor on {returned.device} "
                             f"but received one on {tensor.device}: a hook returns its result on the device it "
                             "received (copy elsewhere inside the hook if you need to)")
        if returned.shape != tensor.shape or returned.dtype != tensor.dtype:
            raise InputError(f"the hook {_hook_label(hook_fn)} on '{hook.name}' returned shape "
                             f"{tuple(returned.shape)} {returned.dtype} but received shape {tuple(tensor.shape)} "
                             f"{tensor.dtype}: a hook returns a tensor of the shape and dtype it received, or None")
        return result

    checked.__name__ = checked.__qualname__ = f"checked({_hook_label(hook_fn)})"
    return checked
