"""One activation row per prompt at each hook point: the reading engine probes and steering vectors share.

Legend: B batch, P position, N flattened tokens, i d_in.
(N counts prompts here, one row each; i is a hook's activation flattened, the width a probe reads.)

``hook_rows`` pads the prompts on the right a batch at a time (causal attention: a real token never sees the
padding after it), runs the blocks only as deep as the deepest hook (``experiments._depth``), and keeps of each
prompt the row it is read at: its last real token (``"last"``), the mean over its real tokens (``"mean"``) or one
token index into its own tokens (negative from its end), as steering-vectors' ``read_token_index``.
``experiments.probes.probe_activations`` and ``experiments.steering.read_contrast_activations`` are its callers.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor

from experiments._depth import stop_at_layer_for
from experiments._progress import Progress, ProgressArg
from workbench.errors import InputError

Prompt = Union[str, Sequence[int], Tensor]
Reading = Union[str, int]  # "last", "mean", or a token index into each prompt (negative: from its end)


def prompt_ids(model, prompt: Prompt) -> list[int]:
    """A prompt's token ids: a text as ``model.to_tokens`` makes them (BOS first where the model adds one), or ids.

    Example:
        >>> prompt_ids(model, "import os") == model.to_tokens("import os")[0].tolist()
        True
        >>> prompt_ids(model, torch.tensor([[5, 6]]))
        [5, 6]
    """
    if isinstance(prompt, str):
        if not prompt:
            raise InputError("a prompt is empty")
        return model.to_tokens(prompt)[0].tolist()
    if isinstance(prompt, Tensor):
        prompt = prompt.reshape(-1).tolist()
    try:
        ids = [int(i) for i in prompt]
    except (TypeError, ValueError):
        raise InputError(f"a prompt must be text or token ids, got {type(prompt).__name__}") from None
    if not ids or min(ids) < 0 or max(ids) >= model.cfg.d_vocab:
        raise InputError(f"a prompt's token ids must be 0..{model.cfg.d_vocab - 1} and not empty")
    return ids


@torch.no_grad()
def hook_rows(model, prompts: Sequence[Prompt], hook_names: Sequence[str], reading: Reading = "last",
              batch_size: int = 16, progress: ProgressArg = False, desc: str = "reading activations",
              reading_name: str = "reading") -> dict[str, Float[Tensor, "N i"]]:
    """Each prompt's row at each of ``hook_names`` (float32, on the CPU), read as ``reading`` says.

    ``reading_name`` is what the caller calls ``reading`` (errors name it).

    Example:
        >>> rows = hook_rows(model, ["import os", "def f(x): return x"], ["blocks.0.hook_resid_post"], reading=1)
        >>> _, cache = model.run_with_cache(model.to_tokens("def f(x): return x"))
        >>> torch.allclose(rows["blocks.0.hook_resid_post"][1], cache["blocks.0.hook_resid_post"][0, 1], atol=1e-5)
        True
    """
    if isinstance(reading, bool) or not (reading in ("last", "mean") or isinstance(reading, int)):
        raise InputError(f"{reading_name} must be 'last', 'mean' or a token index (an int), got {reading!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive int, got {batch_size!r}")
    ids = [prompt_ids(model, prompt) for prompt in prompts]
    stop_at_layer = stop_at_layer_for(model, hook_names)
    rows: dict[str, list[Tensor]] = {name: [] for name in hook_names}
    starts = range(0, len(ids), batch_size)
    with Progress(progress, total=len(starts), desc=desc) as bar:
        for start in starts:
            batch_ids = ids[start:start + batch_size]
            tokens_BP, mask_BP = _right_padded(batch_ids, model.cfg.device)
            _, cache = model.run_with_cache(tokens_BP, names_filter=list(hook_names), stop_at_layer=stop_at_layer,
                                            attention_mask=mask_BP, return_type=None, progress=False)
            lengths = [len(row) for row in batch_ids]
            for name in hook_names:
                rows[name].append(_read(cache[name], lengths, reading, reading_name))
            bar.advance()
    return {name: torch.cat(parts) for name, parts in rows.items()}


def _right_padded(ids: list[list[int]], device) -> tuple[Tensor, Union[Tensor, None]]:
    """[B, P] ids padded on the right with 0 and their mask (None when no row is padded)."""
    width = max(len(row) for row in ids)
    tokens_BP = torch.zeros(len(ids), width, dtype=torch.long)
    mask_BP = torch.zeros(len(ids), width, dtype=torch.bool)
    for row, row_ids in enumerate(ids):
        tokens_BP[row, :len(row_ids)] = torch.tensor(row_ids)
        mask_BP[row, :len(row_ids)] = True
    return tokens_BP.to(device), None if bool(mask_BP.all()) else mask_BP.to(device)


def _read(activation: Tensor, lengths: list[int], reading: Reading, reading_name: str) -> Float[Tensor, "B i"]:
    """One row per prompt of a hook's [B, P, ...] activation (trailing axes flattened), float32 on the CPU."""
    activation_BPi = activation.reshape(*activation.shape[:2], -1).float()
    if reading == "mean":
        lengths_B1 = torch.tensor(lengths, device=activation_BPi.device)[:, None]
        mask_BP1 = (torch.arange(activation_BPi.shape[1], device=activation_BPi.device) < lengths_B1)[..., None].float()
        return ((activation_BPi * mask_BP1).sum(1) / mask_BP1.sum(1)).cpu()
    positions = []
    for n in lengths:
        position = n - 1 if reading == "last" else (n + reading if reading < 0 else reading)
        if not 0 <= position < n:
            raise InputError(f"{reading_name} {reading} is outside a prompt of {n} tokens")
        positions.append(position)
    return activation_BPi[torch.arange(len(lengths)), torch.tensor(positions)].cpu()
