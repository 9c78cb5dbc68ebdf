"""SAELens's ``HookedSAETransformer`` methods on ``Decoder``: a thin forwarding layer, as SAELens's is a thin subclass.

Each method is one line that imports the dictionary package (``workbench.sae.splicing``, where splicing lives, as
hooks over the model's public hook surface) when first called: the model itself knows no dictionary. The names and
arguments are SAELens's (``add_sae``, ``reset_saes``, ``saes``, ``run_with_saes``, ``run_with_cache_with_saes``,
``run_with_hooks_with_saes``, ``acts_to_saes``), so its users' code runs unchanged.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from workbench.host import DecoderHost

if TYPE_CHECKING:
    from workbench.sae.model import SAE

_Host = DecoderHost if TYPE_CHECKING else object
SAEs = Union["SAE", Sequence["SAE"]]


def _splicing() -> Any:
    from workbench.sae import splicing  # the dictionary package, imported only when a dictionary is used

    return splicing


class SAESpliceMethods(_Host):
    """SAELens's ``HookedSAETransformer`` surface, forwarded to ``workbench.sae.splicing``."""

    @property
    def acts_to_saes(self) -> dict[str, "SAE"]:
        """The SAEs spliced now (by ``add_sae`` or an enclosing ``saes`` block), by the hook each reads.

        Example:
            >>> model.acts_to_saes
            {}
        """
        return _splicing().acts_to_saes(self)

    def add_sae(self, sae: "SAE", use_error_term: Optional[bool] = None) -> None:
        """Splices ``sae`` in until ``reset_saes`` (replacing an SAE already reading the same hook, as SAELens
        does). ``use_error_term``: keep the model's output unchanged (None: the SAE's own ``use_error_term``).
        An SAE whose hook or width does not fit the model is an ``InputError`` naming both; nothing is attached.

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=8,
            ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.zeros(128, 8),
            ...     "W_dec": torch.zeros(8, 128), "b_enc": torch.zeros(8), "b_dec": torch.zeros(128)})
            >>> clean = model(tokens)
            >>> model.add_sae(sae, use_error_term=True); model.attached_hooks()
            {'blocks.0.hook_resid_post': 1}
            >>> torch.allclose(model(tokens), clean, atol=1e-5)   # the error term keeps the output
            True
            >>> model.reset_saes(); model.attached_hooks()
            {}
        """
        _splicing().add_sae(self, sae, use_error_term)

    def reset_saes(self, act_names: Union[str, Sequence[str], None] = None) -> None:
        """Removes the SAEs reading ``act_names`` (a hook name or a list; None: every SAE) and every hook a
        user added on their hook points.

        Example:
            >>> model.reset_saes(); model.acts_to_saes
            {}
        """
        _splicing().reset_saes(self, act_names)

    def saes(self, saes: SAEs = (), reset_saes_end: bool = True,
             use_error_term: Optional[bool] = None) -> AbstractContextManager:
        """A block with ``saes`` spliced in; on leaving (even after an error) they are removed and any SAE they
        replaced is back. Holds the model's lock for the block, as ``hooks`` does.

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("topk", d_in=128, d_sae=16, k=4,
            ...     metadata={"hook_name": "blocks.1.hook_resid_pre"}), {"W_enc": torch.randn(128, 16),
            ...     "W_dec": torch.randn(16, 128), "b_enc": torch.zeros(16), "b_dec": torch.zeros(128)})
            >>> with model.saes(saes=[sae]):
            ...     _, sae_cache = model.run_with_cache(tokens, names_filter=lambda n: "hook_sae" in n)
            >>> sorted(sae_cache.keys())[:2], model.attached_hooks()
            (['blocks.1.hook_resid_pre.hook_sae_acts_post', 'blocks.1.hook_resid_pre.hook_sae_acts_pre'], {})
        """
        return _splicing().spliced(self, saes, reset_saes_end, use_error_term)

    def run_with_saes(self, *model_args: Any, saes: SAEs = (), reset_saes_end: bool = True,
                      use_error_term: Optional[bool] = None, **model_kwargs: Any) -> Any:
        """The model's forward with ``saes`` spliced in for this call only (SAELens's ``run_with_saes``).

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=8,
            ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.zeros(128, 8),
            ...     "W_dec": torch.zeros(8, 128), "b_enc": torch.zeros(8), "b_dec": torch.zeros(128)})
            >>> spliced = model.run_with_saes(tokens, saes=[sae])   # layer 0's output replaced by zeros
            >>> torch.allclose(spliced, model(tokens)), model.attached_hooks()
            (False, {})
        """
        with self.saes(saes=saes, reset_saes_end=reset_saes_end, use_error_term=use_error_term):
            return self(*model_args, **model_kwargs)

    def run_with_cache_with_saes(self, *model_args: Any, saes: SAEs = (), reset_saes_end: bool = True,
                                 use_error_term: Optional[bool] = None, return_cache_object: bool = True,
                                 **kwargs: Any) -> tuple[Any, Any]:
        """``run_with_cache`` with ``saes`` spliced in: the cache also holds each SAE's hooks under
        ``"{hook_name_out}.hook_sae_input"``, ``.hook_sae_acts_pre``, ``.hook_sae_acts_post``, ``.hook_sae_recons``,
        ``.hook_sae_output`` (and ``.hook_sae_error`` with the error term). ``names_filter`` and the other
        ``run_with_cache`` arguments pass through; ``return_cache_object=False`` returns a plain dict.

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=8,
            ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.randn(128, 8),
            ...     "W_dec": torch.randn(8, 128), "b_enc": torch.zeros(8), "b_dec": torch.zeros(128)})
            >>> out, sae_cache = model.run_with_cache_with_saes(tokens, saes=[sae], use_error_term=True,
            ...     names_filter=["blocks.0.hook_resid_post.hook_sae_acts_post", "blocks.0.hook_resid_pre"])
            >>> sae_cache["blocks.0.hook_resid_post.hook_sae_acts_post"].shape, torch.allclose(out, logits, atol=1e-4)
            (torch.Size([1, 14, 8]), True)
        """
        with self.saes(saes=saes, reset_saes_end=reset_saes_end, use_error_term=use_error_term):
            out, cache = self.run_with_cache(*model_args, **kwargs)
        return out, (cache if return_cache_object else dict(cache.items()))

    def run_with_hooks_with_saes(self, *model_args: Any, saes: SAEs = (), reset_saes_end: bool = True,
                                 use_error_term: Optional[bool] = None, fwd_hooks: Sequence = (),
                                 bwd_hooks: Sequence = (), reset_hooks_end: bool = True, clear_contexts: bool = False,
                                 **model_kwargs: Any) -> Any:
        """``run_with_hooks`` with ``saes`` spliced in; hooks may name the SAEs' hook points
        (``"{hook_name_out}.hook_sae_acts_post"``).

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=8,
            ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.randn(128, 8),
            ...     "W_dec": torch.randn(8, 128), "b_enc": torch.zeros(8), "b_dec": torch.zeros(128)})
            >>> def zero_feature_0(acts, hook):
            ...     acts[..., 0] = 0
            ...     return acts
            >>> edited = model.run_with_hooks_with_saes(tokens, saes=[sae], use_error_term=True,
            ...     fwd_hooks=[("blocks.0.hook_resid_post.hook_sae_acts_post", zero_feature_0)])
            >>> edited.shape, model.attached_hooks()
            (torch.Size([1, 14, 2048]), {})
        """
        with self.saes(saes=saes, reset_saes_end=reset_saes_end, use_error_term=use_error_term):
            return self.run_with_hooks(*model_args, fwd_hooks=list(fwd_hooks), bwd_hooks=list(bwd_hooks),
                                       reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts,
                                       **model_kwargs)
