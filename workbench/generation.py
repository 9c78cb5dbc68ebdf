"""Text generation with a per-layer KV cache: greedy, temperature, top-k and top-p sampling.

Legend: B batch, P position, V d_vocab.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Union

import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from workbench.components.attention import LayerKVCache
from workbench.errors import InputError
from workbench.host import DecoderHost


class KVCache:
    """One ``LayerKVCache`` per layer; ``length`` is the number of positions already seen; ``mask_BS``
    which of them are real tokens (padded batches; None: every one).

    Example:
        >>> kv_cache = KVCache(model.cfg.n_layers)
        >>> _ = model(tokens, kv_cache=kv_cache)                 # the prompt's keys and values stay cached
        >>> model(tokens[:, -1:], kv_cache=kv_cache).shape        # so a step feeds only the new token
        torch.Size([1, 1, 2048])
        >>> kv_cache.length
        15
    """

    def __init__(self, n_layers: int):
        self.layers = [LayerKVCache() for _ in range(n_layers)]
        self.mask_BS: Optional[Tensor] = None  # which cached positions are real tokens (None: all)

    @property
    def length(self) -> int:
        """Positions cached so far.

        Example:
            >>> kv_cache = KVCache(model.cfg.n_layers)
            >>> kv_cache.length
            0
            >>> _ = model(tokens, kv_cache=kv_cache)
            >>> kv_cache.length
            14
        """
        return self.layers[0].length


def generate_tokens(
    model: DecoderHost,
    tokens_BP: Int[Tensor, "batch pos"],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: Optional[int] = None,
    use_kv_cache: bool = True,
    stop_at_eos: bool = True,
    verbose: bool = False,
    attention_mask: Optional[Int[Tensor, "batch pos"]] = None,
    keep_logits: bool = True,
) -> tuple[Int[Tensor, "batch pos_plus_new"], Optional[Float[Tensor, "batch new d_vocab"]]]:
    """Appends up to ``max_new_tokens`` to each row; returns the tokens and each step's logits (None
    with ``keep_logits=False``: at batch 8 and 128 steps SmolLM2's would be 200 MB).

    ``temperature=0`` is greedy. With ``use_kv_cache`` each step feeds only the newest token.
    ``attention_mask`` (1 = real token) lets prompts of different lengths share a batch: they must be
    left-padded, so every row's last position is a real token; each row then continues exactly as
    its prompt alone would, and stops at its own EOS (later steps repeat EOS in that row).

    Example:
        >>> out, step_logits = generate_tokens(model, tokens, 5)
        >>> out.shape, step_logits.shape   # 14 prompt tokens + 5 new ones; the logits of each step
        (torch.Size([1, 19]), torch.Size([1, 5, 2048]))
        >>> model.to_string(out[0, 14:])   # greedy: after " cat" the model copies " sat"
        ' sat sat s'
        >>> sampled = [generate_tokens(model, tokens, 5, temperature=1.0, seed=0)[0] for _ in range(2)]
        >>> torch.equal(*sampled)          # a seed fixes the samples
        True
    """
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    check_sampling(temperature, top_k, top_p)  # before any step runs
    tokens_BP, mask_BP = model.as_tokens_and_mask(tokens_BP, attention_mask=attention_mask)
    if mask_BP is not None and not bool(mask_BP[:, -1].all()):
        raise InputError("generation needs left padding (every row's last token real): pad with "
                         "padding_side='left'")
    limit = model.cfg.context_limit  # None: dynamic RoPE extends the context, as in transformers
    if limit is not None and tokens_BP.shape[1] + max_new_tokens > limit:
        raise InputError(f"prompt ({tokens_BP.shape[1]} tokens) plus max_new_tokens={max_new_tokens} "
                         f"exceeds the model's context (n_ctx={model.cfg.n_ctx})")
    generator = torch.Generator(device=tokens_BP.device).manual_seed(seed) if seed is not None else None
    eos = model.tokenizer.eos_token_id if (stop_at_eos and model.tokenizer is not None) else None
    cache = KVCache(model.cfg.n_layers) if use_kv_cache else None
    finished_B = torch.zeros(tokens_BP.shape[0], dtype=torch.bool, device=tokens_BP.device)
    step_logits = []
    next_input, step_mask = tokens_BP, mask_BP
    regime_length = model.cfg.rotary_regime_length  # longrope: longer calls rotate every position differently
    with torch.no_grad():
        for _ in tqdm(range(max_new_tokens), disable=not verbose, desc="generating"):
            if cache is not None and regime_length is not None and cache.length <= regime_length < tokens_BP.shape[1]:
                # The cached keys were rotated with the short factors: the whole prefix again, as transformers'
                # Phi-3 does when generation crosses original_max_position_embeddings.
                cache, next_input = KVCache(model.cfg.n_layers), tokens_BP
                step_mask = None if mask_BP is None else torch.nn.functional.pad(
                    mask_BP, (0, tokens_BP.shape[1] - mask_BP.shape[1]), value=True)
            # Only the last position is unembedded (the final norm's hooks still see every position).
            resid_BPD = model(next_input, kv_cache=cache, attention_mask=step_mask, stop_at_layer=model.cfg.n_layers)
            logits_BV = model.unembed(model.apply_final_norm(resid_BPD)[:, -1]).float()
            if keep_logits:
                step_logits.append(logits_BV)
            new_B = sample_next(logits_BV, temperature, top_k, top_p, generator)
            if eos is not None:
                new_B = new_B.masked_fill(finished_B, eos)
                finished_B |= new_B == eos
            tokens_BP = torch.cat([tokens_BP, new_B[:, None]], dim=1)
            if use_kv_cache:  # the cache remembers the prompt's mask; new tokens are real
                next_input, step_mask = new_B[:, None], None
            else:
                next_input = tokens_BP
                step_mask = None if mask_BP is None else torch.nn.functional.pad(mask_BP, (0, tokens_BP.shape[1] - mask_BP.shape[1]), value=True)
            if eos is not None and bool(finished_B.all()):
                break
    return tokens_BP, torch.stack(step_logits, dim=1) if keep_logits else None


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """``InputError`` naming the argument unless ``temperature`` is a finite number >= 0, ``top_k``
    None or an integer >= 1, and ``top_p`` None or a number in [0, 1] (NaN fails every comparison,
    so each test is written to refuse it).

    Example:
        >>> check_sampling(1.0, top_k=5, top_p=0.9)   # fine: returns None
        >>> check_sampling(float("nan"), None, None)
        Traceback (most recent call last):
        workbench.errors.InputError: temperature must be a finite number >= 0 (0: greedy), got nan
    """
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not (
            math.isfinite(temperature) and temperature >= 0):
        raise InputError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise InputError(f"top_k must be None or an integer >= 1 (the number of tokens kept), got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 <= top_p <= 1):
        raise InputError(f"top_p must be None or a probability in [0, 1] (the nucleus kept), got {top_p!r}")


def sample_next(
    logits_BV: Float[Tensor, "batch d_vocab"],
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> Int[Tensor, "batch"]:
    """Greedy argmax at temperature 0; otherwise a sample after top-k / nucleus filtering.

    Example:
        >>> logits = torch.tensor([[1.0, 3.0, 2.0]])   # probabilities 0.09, 0.67, 0.24
        >>> sample_next(logits), sample_next(logits, temperature=1.0, top_k=1)
        (tensor([1]), tensor([1]))
        >>> generator = torch.Generator().manual_seed(0)
        >>> sample_next(logits.expand(100, 3), 1.0, top_p=0.8, generator=generator).unique()   # the top two
        tensor([1, 2])
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0.0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV / temperature
    if top_k is not None:
        kth = torch.topk(logits_BV, min(top_k, logits_BV.shape[-1]), dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits_BV, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token crossing p
        logits_BV = logits_BV.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    probs = torch.softmax(logits_BV, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def generate(
    model: DecoderHost, input: Union[str, list[str], Tensor], max_new_tokens: int = 20,
    prepend_bos: Optional[bool] = None, **kwargs
) -> Union[str, list[str], Tensor]:
    """Text in -> text out (prompt plus continuation, without the BOS the tokenizer added, as
    TransformerLens); token ids in -> token ids out.

    Example:
        >>> generate(model, "if __name__ ==", 6)   # greedy; the toy model has read the standard library
        "if __name__ == '__main__': ' '"
        >>> model.to_str_tokens(generate(model, tokens, 3)[0, -3:])   # ids in, ids out
        [' s', 'at', ' s']
    """
    as_text = isinstance(input, (str, list))
    if not as_text:
        return generate_tokens(model, input, max_new_tokens, keep_logits=False, **kwargs)[0]
    tokens_BP, mask_BP = model.to_tokens_and_mask(input, prepend_bos=prepend_bos, padding_side="left")
    out_BP, _ = generate_tokens(model, tokens_BP, max_new_tokens, attention_mask=mask_BP, keep_logits=False, **kwargs)
    texts = []
    for row, mask in zip(out_BP, mask_BP):
        start = int((~mask.bool()).sum()) + int(model.bos_first(prepend_bos))  # past the pads and BOS
        texts.append(model.to_string(_up_to_first_eos(row[start:], tokens_BP.shape[1] - start, model)))
    return texts[0] if isinstance(input, str) else texts


def _up_to_first_eos(row: Tensor, prompt_length: int, model: DecoderHost) -> Tensor:
    """The row up to its first generated EOS (kept), dropping the EOS repeats that fill a finished row."""
    eos = model.tokenizer.eos_token_id if model.tokenizer is not None else None
    if eos is None:
        return row
    generated_eos = (row[prompt_length:] == eos).nonzero()
    return row if len(generated_eos) == 0 else row[:prompt_length + int(generated_eos[0]) + 1]
