"""A prompt's continuation from the clean model beside its continuation with an ablation applied.

Legend: B batch, P position, V d_vocab.

Both runs call ``workbench.generation.generate_tokens`` with the same settings and the same seed,
so a sampled continuation differs only where the ablation changes the model's distribution. The
ablation is ``experiments.ablation.ablation_hooks`` attached with ``model.hooks`` for the length
of the run: removed afterwards, also when generation raises.

The KV cache: with it each step feeds only the newest token, so a hook sees one position and
cannot tell which. Zero ablation does not depend on the position and runs with the cache. Mean
and resample ablation write the reference's activation at the same position, so they run without
the cache (each step reruns the whole sequence and the hook sees every position at its own index)
and need a reference of at least P + max_new_tokens - 1 tokens, the longest input a step runs.

Log-probs are the model's own (temperature 1, before top-k) for the token chosen at each step.
``experiments.plots.continuations`` draws a continuation as HTML.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from experiments._tokens import str_tokens
from workbench.tokens_api import TextOrTokens
from experiments.ablation import AblationTarget, ablation_hooks
from experiments.metrics import prompt_batch
from workbench.errors import InputError
from workbench.generation import generate_tokens

__all__ = ["Continuations", "continue_under_hooks", "continue_with_ablation", "first_divergence"]

TargetLike = Union[AblationTarget, tuple]


@dataclass(frozen=True)
class Continuations:
    """The clean and the ablated continuation of one prompt: new token ids, their texts and log-probs.

    ``first_divergence`` is the first step where the two differ (None when they are the same); ``targets``
    names what was ablated ("head L3H1", "attn_layer 2", "neuron L3N17", "expert L1E3").

    Example:
        >>> result = continue_with_ablation(model, "The cat sat on the mat. The cat", [AblationTarget("head", 0, 3)],
        ...                                 max_new_tokens=4)
        >>> result.clean_text, result.ablated_text, result.first_divergence, result.targets
        (' sat sat', ' sat on the', 2, ('head L0H3',))
    """

    prompt_tokens: tuple[int, ...]
    clean_tokens: tuple[int, ...]
    ablated_tokens: tuple[int, ...]
    clean_str_tokens: tuple[str, ...]
    ablated_str_tokens: tuple[str, ...]
    clean_logprobs: tuple[float, ...]
    ablated_logprobs: tuple[float, ...]
    first_divergence: Optional[int]
    method: str
    targets: tuple[str, ...]

    @property
    def clean_text(self) -> str:
        return "".join(self.clean_str_tokens)

    @property
    def ablated_text(self) -> str:
        return "".join(self.ablated_str_tokens)

    def to_frame(self) -> pd.DataFrame:
        """One row per step: each continuation's token, id and log-prob (missing past a run's end) and ``same``.

        Example:
            >>> result = continue_with_ablation(model, "The cat sat on the mat. The cat", [("head", 0, 3)],
            ...                                 max_new_tokens=4)
            >>> result.to_frame().columns.tolist()
            ['step', 'clean_token', 'clean_token_id', 'clean_logprob', 'ablated_token', 'ablated_token_id', 'ablated_logprob', 'same']
        """
        steps = max(len(self.clean_tokens), len(self.ablated_tokens))

        def column(values: Sequence) -> list:
            return [values[i] if i < len(values) else None for i in range(steps)]

        table = pd.DataFrame({
            "step": range(steps),
            "clean_token": column(self.clean_str_tokens),
            "clean_token_id": pd.array(column(self.clean_tokens), dtype="Int64"),  # ids stay ints beside a gap
            "clean_logprob": column(self.clean_logprobs),
            "ablated_token": column(self.ablated_str_tokens),
            "ablated_token_id": pd.array(column(self.ablated_tokens), dtype="Int64"),
            "ablated_logprob": column(self.ablated_logprobs),
        })
        table["same"] = (table["clean_token_id"] == table["ablated_token_id"]).fillna(False).astype(bool)
        return table


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """The first index where ``a`` and ``b`` differ (a shorter one ends there), or None when they are equal.

    Example:
        >>> first_divergence([1, 2, 3], [1, 5, 3]), first_divergence([1, 2], [1, 2, 3]), first_divergence([4], [4])
        (1, 2, None)
    """
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def continue_under_hooks(model, tokens: Int[Tensor, "1 pos"], fwd_hooks: Sequence[tuple], max_new_tokens: int = 20,
                         *, temperature: float = 0.0, top_k: Optional[int] = None, seed: Optional[int] = 0,
                         use_kv_cache: bool = True) -> tuple[Int[Tensor, "new"], Float[Tensor, "new"]]:
    """The new tokens of a continuation of ``tokens`` generated with ``fwd_hooks`` attached, and their log-probs.

    The hooks are attached through ``model.hooks`` and removed when the run ends or raises. It stops
    at the model's end-of-text token (kept) or after ``max_new_tokens``.

    Example:
        >>> zero = lambda z, hook: z.index_fill(2, torch.tensor([1]), 0.0)
        >>> ids, logprobs = continue_under_hooks(model, model.to_tokens("The cat"), [("blocks.0.attn.hook_z", zero)],
        ...                                      max_new_tokens=4)
        >>> model.to_string(ids), logprobs.shape   # with head L0H1 zeroed
        (' ( ( " "', torch.Size([4]))
    """
    with model.hooks(fwd_hooks=list(fwd_hooks)):
        # step_logits: [batch, new, d_vocab], the logits each step chose from
        out_BP, step_logits = generate_tokens(model, tokens, max_new_tokens, temperature=temperature, top_k=top_k,
                                              seed=seed, use_kv_cache=use_kv_cache)
    new_P = out_BP[0, tokens.shape[1]:]  # P here: the generated positions
    eos = model.tokenizer.eos_token_id if model.tokenizer is not None else None
    if eos is not None and bool((new_P == eos).any()):  # rows stop at EOS; keep it, drop what a batch would pad
        new_P = new_P[:int((new_P == eos).nonzero()[0]) + 1]
    logprobs_PV = step_logits[0, :len(new_P)].float().log_softmax(-1)
    return new_P.cpu(), logprobs_PV.gather(1, new_P[:, None].to(logprobs_PV.device))[:, 0].cpu()


def _as_targets(targets: Sequence[TargetLike]) -> list[AblationTarget]:
    """``AblationTarget``s from targets or (kind, layer, index) tuples."""
    targets = [t if isinstance(t, AblationTarget) else AblationTarget(*t) for t in targets]
    if not targets:
        raise InputError("no ablation targets given: choose at least one head, layer, neuron or expert to ablate")
    return targets


def _label(target: AblationTarget) -> str:
    """A short name of what ``target`` ablates: "head L3H1", "attn_layer 2", "neuron L3N17", "expert L1E3"."""
    letter = {"head": "H", "neuron": "N", "expert": "E"}.get(target.kind)
    return f"{target.kind} L{target.layer}{letter}{target.index}" if letter else f"{target.kind} {target.layer}"


def _check_reference(model, reference_tokens: Optional[TextOrTokens], method: str, need: int) -> None:
    """Mean and resample ablation read the reference at every position a generation step runs."""
    if method == "zero":
        return
    if reference_tokens is None:
        raise InputError(f"{method} ablation needs reference_tokens: the prompts whose activations replace the "
                         f"prompt's (zero ablation needs none)")
    batch = prompt_batch(model, reference_tokens)
    lengths_R = (torch.full((batch.size,), batch.tokens.shape[1]) if batch.mask is None
                 else batch.mask.sum(1).cpu())
    have = int(lengths_R.max()) if method == "mean" else int(lengths_R[0])  # resample: the one prompt takes row 0
    if have < need:
        raise InputError(f"{method} ablation during generation reads the reference at every position up to the "
                         f"last generated one: it needs {need} tokens (prompt plus max_new_tokens - 1), the "
                         f"reference has {have}. Give a longer reference or fewer new tokens.")


def continue_with_ablation(model, prompt: TextOrTokens, targets: Sequence[TargetLike], method: str = "zero",
                           max_new_tokens: int = 20, temperature: float = 0.0, top_k: Optional[int] = None,
                           seed: Optional[int] = 0, reference_tokens: Optional[TextOrTokens] = None) -> Continuations:
    """The clean continuation of ``prompt`` and the one with ``targets`` ablated, same settings and seed.

    ``targets``: ``AblationTarget``s or (kind, layer, index) tuples; ``method`` "zero", "mean" or
    "resample" (mean and resample need ``reference_tokens`` of at least P + max_new_tokens - 1
    tokens and run without the KV cache, see the module docstring). ``temperature=0`` is greedy;
    otherwise a sample after ``top_k`` filtering from ``seed``.

    Example:
        >>> result = continue_with_ablation(model, "The cat sat on the mat. The cat", [("head", 0, 3)], max_new_tokens=4)
        >>> result.to_frame()[["step", "clean_token", "ablated_token", "same"]]
           step clean_token ablated_token   same
        0     0           s             s   True
        1     1          at            at   True
        2     2           s            on  False
        3     3          at           the  False
    """
    targets = _as_targets(targets)
    batch = prompt_batch(model, prompt)
    if batch.size != 1 or batch.mask is not None:
        raise InputError(f"continue_with_ablation continues one prompt, got {batch.size} rows")
    tokens_1P = batch.tokens
    _check_reference(model, reference_tokens, method, tokens_1P.shape[1] + max_new_tokens - 1)
    hooks = ablation_hooks(model, targets, method, reference_tokens)
    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    clean_P, clean_lp = continue_under_hooks(model, tokens_1P, [], **settings)
    ablated_P, ablated_lp = continue_under_hooks(model, tokens_1P, hooks, use_kv_cache=method == "zero", **settings)
    clean_ids, ablated_ids = tuple(clean_P.tolist()), tuple(ablated_P.tolist())
    return Continuations(
        prompt_tokens=tuple(tokens_1P[0].tolist()), clean_tokens=clean_ids, ablated_tokens=ablated_ids,
        clean_str_tokens=tuple(str_tokens(model, clean_P)), ablated_str_tokens=tuple(str_tokens(model, ablated_P)),
        clean_logprobs=tuple(clean_lp.tolist()), ablated_logprobs=tuple(ablated_lp.tolist()),
        first_divergence=first_divergence(clean_ids, ablated_ids), method=method,
        targets=tuple(_label(t) for t in targets))
