"""Training a tuned lens: each layer's translator fitted so that its readout matches the model's final distribution.

Legend: B batch, P position, L n_layers, D d_model, V d_vocab, N flattened tokens.

The loss at layer l is tuned-lens 0.2's: KL(final || lens_l), the final distribution being the model's own
(``model.logits_from_resid`` of the stream after the last block), averaged over positions; the layers' losses are
summed (each translator sees only its own). Memory is bounded: one batch of windows runs forward without gradients,
keeping the streams at the positions read ([L, N, D]); the lens logits are then made ``chunk_tokens`` positions at a
time ([chunk, V] per layer), each chunk's gradient accumulated before the next. The model's weights never get
gradients. A step is ``tokens_per_step`` positions; the learning rate warms up linearly then decays linearly to zero
(tuned-lens's schedule). ``init="least_squares"`` first sets each translator to the ridge least-squares map from
the stream entering block l to the final stream, divided by its RMS (the final norm's input direction), on
``init_tokens`` positions (Din et al. 2023's linear shortcut), scaled back to the RMS of the stream it reads (the
final norm is blind to the scale; at the stream's scale A = map - I stays far from -I, which float16 files and AdamW
steps need on a model with a large stream, Gemma 3's): forward passes only, a cheap warm start before the KL steps
when compute is short. With ``checkpoint_dir`` the translators, the optimizer, the step and the data cursor are
saved every ``checkpoint_every`` steps (atomically) and a later call with the same arguments resumes from them.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from jaxtyping import Float, Int
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments.lenses.checkpoints import CHECKPOINT_FILE, resume, save_checkpoint
from workbench.errors import InputError
OPTIMIZERS = ("adam", "sgd")
PRECISIONS = ("float32", "bfloat16")


def training_windows(model, data: Union[Tensor, Sequence[str]], window: int = 128) -> Int[Tensor, "batch pos"]:
    """``data`` as windows of token ids: a [B, P] tensor as it is, a list of texts cut by
    ``experiments.datasets.corpus_windows`` into ``window``-token windows.

    Example:
        >>> training_windows(model, ["def f(x):\\n    return x + 1\\n" * 20], window=32).shape[1]
        32
    """
    if isinstance(data, Tensor):
        if data.dim() != 2 or data.dtype not in (torch.int64, torch.int32) or data.shape[1] < 2:
            raise InputError(f"data must be token windows [batch, pos >= 2] of integers, got {tuple(data.shape)} "
                             f"{data.dtype}")
        return data.long()
    if isinstance(data, str) or not isinstance(data, Sequence) or not all(isinstance(t, str) for t in data):
        raise InputError("data must be a [batch, pos] tensor of token ids or a list of texts")
    from experiments.datasets import corpus_windows

    return corpus_windows(model, list(data), window=window)


@contextmanager
def _frozen(model):
    """The model's weights without gradients while the lens trains (restored after)."""
    params = list(model.parameters()) if hasattr(model, "parameters") else []
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


@torch.no_grad()
def streams_and_targets(model, tokens_BP: Int[Tensor, "batch pos"], first: int
                        ) -> tuple[Float[Tensor, "layers N D"], Float[Tensor, "N D"]]:
    """The streams entering each block and after the last, at positions ``first:`` of every window, flattened.

    Example:
        >>> hidden, final = streams_and_targets(model, tokens, first=1)
        >>> hidden.shape, final.shape   # 2 layers, 13 positions after BOS
        (torch.Size([2, 13, 128]), torch.Size([13, 128]))
    """
    L = model.cfg.n_layers
    names = [f"blocks.{l}.hook_resid_pre" for l in range(L)] + [f"blocks.{L - 1}.hook_resid_post"]
    kept: dict[str, Tensor] = {}

    def keep(resid_BPD: Tensor, hook) -> None:
        kept[hook.name] = resid_BPD[:, first:].reshape(-1, resid_BPD.shape[-1]).detach()

    model.run_with_hooks(tokens_BP, stop_at_layer=L, fwd_hooks=[(name, keep) for name in names])
    return torch.stack([kept[name] for name in names[:-1]]), kept[names[-1]]


def kl_to_final(lens_logits_NV: Tensor, final_logprobs_NV: Tensor,
                final_terms: Optional[tuple[Tensor, Tensor]] = None) -> Tensor:
    """Mean over positions of KL(final || lens) = sum p log p - sum p log q, in nats (float32).

    ``final_terms``: ``final_kl_terms(final_logprobs_NV)``, computed once when several lenses (layers) are scored
    against the same final distribution.

    Example:
        >>> logits = torch.randn(4, 10)
        >>> float(kl_to_final(logits, logits.log_softmax(-1)))
        0.0
    """
    terms = final_kl_terms(final_logprobs_NV) if final_terms is None else final_terms
    return kl_per_position(lens_logits_NV.float().log_softmax(-1), terms).mean()


def kl_per_position(lens_logprobs_NV: Tensor, final_terms: tuple[Tensor, Tensor]) -> Tensor:
    """KL(final || lens) at each position [N], in nats, from the lens's log-probabilities and ``final_kl_terms``:
    the one formula training and evaluation score a lens by.

    Example:
        >>> final = torch.tensor([[0.5, 0.5]]).log()
        >>> round(float(kl_per_position(torch.tensor([[0.25, 0.75]]).log(), final_kl_terms(final))[0]), 4)  # by hand
        0.1438
    """
    probs_NV, neg_entropy_N = final_terms
    return neg_entropy_N - (probs_NV * lens_logprobs_NV).sum(-1)


def final_kl_terms(final_logprobs_NV: Tensor) -> tuple[Tensor, Tensor]:
    """The parts of KL(final || lens) that depend only on the final distribution: its probabilities and sum p log p.

    Example:
        >>> probs, neg_entropy = final_kl_terms(torch.full((1, 4), 0.25).log())
        >>> round(float(neg_entropy[0]), 4)   # -log 4
        -1.3863
    """
    probs_NV = final_logprobs_NV.exp()
    return probs_NV, (probs_NV * final_logprobs_NV).sum(-1)


def _optimizer(params, name: str, lr: float, weight_decay: float):
    if name == "adam":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":  # tuned-lens 0.2's default: Nesterov SGD, momentum 0.9
        return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True, weight_decay=weight_decay)
    raise InputError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def fit_translators(model, lens, data: Union[Tensor, Sequence[str]], *,
                    tokens: Optional[int] = None, tokens_per_step: int = 1024, batch_windows: int = 2,
                    chunk_tokens: int = 128, window: int = 128, optimizer: str = "adam", lr: float = 1e-3,
                    weight_decay: float = 1e-3, warmup_steps: Optional[int] = None,
                    checkpoint_dir: Optional[Union[str, Path]] = None, checkpoint_every: int = 5,
                    progress: ProgressArg = True, seed: int = 0, init: str = "identity",
                    init_tokens: int = 2048, ridge: float = 1e-3, precision: str = "float32") -> list[dict]:
    """Trains ``lens`` (a ``TunedLens`` attached to ``model``) in place; returns the log, one row per step (step,
    tokens, lr, the mean KL of each layer). The public entry is ``train_tuned_lens`` (``TunedLens.train``).

    ``data``: token windows [B, P] or texts (cut into ``window``-token windows). ``tokens``: positions to train on
    (default one pass over ``data``; more cycles through it, reshuffled; 0: the warm start alone); the BOS position
    is not read. ``optimizer``: "adam" (AdamW) or "sgd" (tuned-lens's Nesterov SGD; its own default lr is 1.0).
    ``init``: "identity" (tuned-lens's) or "least_squares" (a warm start on ``init_tokens`` positions, ``ridge``
    times the mean input energy added to the diagonal). ``precision="bfloat16"``: the lens's translators and
    readout run under bfloat16 autocast, as tuned-lens 0.2's trainer runs them (the KL itself in float32): on a CPU
    with bfloat16 units (AVX512-BF16, AMX) its matmuls ran 5x faster than float32's here, elsewhere slower.

    Example:
        >>> from experiments.lenses import TunedLens
        >>> lens = TunedLens.for_model(model)
        >>> log = fit_translators(model, lens, tokens.repeat(4, 1), tokens=52, tokens_per_step=26, progress=False)
        >>> [row["step"] for row in log], bool(lens.layer_translators[0].weight.abs().sum() > 0)
        ([1, 2], True)
    """
    for name, value in (("tokens_per_step", tokens_per_step), ("batch_windows", batch_windows),
                        ("chunk_tokens", chunk_tokens), ("checkpoint_every", checkpoint_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    if not lr > 0:
        raise InputError(f"lr must be positive, got {lr!r}")
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    windows_BP = training_windows(model, data, window)
    first = 1 if model.bos_first() and windows_BP.shape[1] > 1 else 0
    per_window = windows_BP.shape[1] - first
    total = tokens if tokens is not None else windows_BP.shape[0] * per_window
    if isinstance(total, bool) or not isinstance(total, int) or total < 0 or (total == 0 and init == "identity"):
        raise InputError(f"tokens must be a positive integer (0 only after init='least_squares'), got {tokens!r}")
    n_steps = math.ceil(total / tokens_per_step)
    warmup = max(1, n_steps // 10) if warmup_steps is None else warmup_steps
    lens.to(torch.float32)
    params = list(lens.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = _optimizer(params, optimizer, lr, weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (n_steps - s) / max(1, n_steps - warmup))))
    state = {"step": 0, "tokens": 0, "cursor": 0, "log": []}
    checkpoint = Path(checkpoint_dir) / CHECKPOINT_FILE if checkpoint_dir is not None else None
    if checkpoint is not None and checkpoint.is_file():
        state = resume(checkpoint.parent, lens, opt, schedule, n_steps)
    elif init == "least_squares":
        least_squares_init(model, lens, windows_BP, first, init_tokens, ridge, seed)
        if checkpoint is not None:  # the warm start is kept: a resumed run does not redo it
            save_checkpoint(checkpoint, lens, opt, schedule, state, n_steps)
    elif init != "identity":
        raise InputError(f"init must be 'identity' or 'least_squares', got {init!r}")
    order = _order(windows_BP.shape[0], seed)
    L = lens.n_layers
    try:
        with _frozen(model), Progress(progress, total=n_steps, desc="tuned lens") as bar:
            bar.advance(state["step"])
            while state["step"] < n_steps:
                step_kl = torch.zeros(L)
                step_tokens = 0
                while step_tokens < tokens_per_step:
                    cursor = state["cursor"]
                    epoch, at = divmod(cursor, windows_BP.shape[0])
                    if at == 0:
                        order = _order(windows_BP.shape[0], seed + epoch)
                    rows = order[at:at + batch_windows]
                    state["cursor"] = cursor + len(rows)
                    hidden_LND, final_ND = streams_and_targets(model, windows_BP[rows], first)
                    take = min(hidden_LND.shape[1], tokens_per_step - step_tokens)
                    step_kl += _accumulate(model, lens, hidden_LND[:, :take], final_ND[:take], chunk_tokens,
                                           tokens_per_step, precision)
                    step_tokens += take
                opt.step()
                schedule.step()
                opt.zero_grad(set_to_none=True)
                state["step"] += 1
                state["tokens"] += step_tokens
                state["log"].append({"step": state["step"], "tokens": state["tokens"],
                                     "lr": schedule.get_last_lr()[0], **{f"kl_{l}": float(step_kl[l]) for l in range(L)}})
                bar.advance()
                if checkpoint is not None and (state["step"] % checkpoint_every == 0 or state["step"] == n_steps):
                    save_checkpoint(checkpoint, lens, opt, schedule, state, n_steps)
    finally:
        for p in params:
            p.requires_grad_(False)
    return state["log"]


@torch.no_grad()
def least_squares_init(model, lens, windows_BP: Tensor, first: int, tokens: int, ridge: float = 1e-3,
                       seed: int = 0):
    """Sets each translator to the ridge least-squares affine map from the stream entering block l to the final
    stream divided by its RMS, over ``tokens`` positions of ``windows_BP`` (a seeded order), times the RMS of the
    stream it reads (so the translated stream keeps that scale; the final norm removes it); returns the lens.

    Example:
        >>> from experiments.lenses import TunedLens
        >>> lens = least_squares_init(model, TunedLens.for_model(model), tokens.repeat(8, 1), 1, tokens=104)
        >>> bool(lens.layer_translators[0].weight.abs().sum() > 0)
        True
    """
    L, D = lens.n_layers, lens.config.d_model
    gram = torch.zeros(L, D + 1, D + 1, dtype=torch.float64)
    cross = torch.zeros(L, D + 1, D, dtype=torch.float64)
    order, seen = _order(windows_BP.shape[0], seed), 0
    for row in order.tolist():
        if seen >= tokens:
            break
        hidden_LND, final_ND = streams_and_targets(model, windows_BP[row:row + 1], first)
        target = final_ND.double() / final_ND.double().pow(2).mean(-1, keepdim=True).sqrt()
        inputs = torch.cat([hidden_LND.double(), torch.ones(L, hidden_LND.shape[1], 1, dtype=torch.float64)], -1)
        gram += inputs.transpose(1, 2) @ inputs
        cross += inputs.transpose(1, 2) @ target
        seen += hidden_LND.shape[1]
    energy = gram.diagonal(dim1=1, dim2=2)[:, :D].mean(-1)  # [L]: the mean input energy per dimension
    regularised = gram + ridge * energy[:, None, None] * torch.eye(D + 1, dtype=torch.float64)
    maps = torch.linalg.solve(regularised, cross)  # [L, D + 1, D]: [h, 1] @ map
    # The map reaches the final stream over its RMS (~1); the final norm does not see the scale, so it is multiplied
    # by the input stream's RMS: the translated stream keeps the scale of the stream it reads, as the identity does.
    # Unscaled, a layer whose stream has RMS r got entries ~1/r, so A = map - I sat within 1/r of -I: on Gemma 3
    # (r ~ 1,350 at layer 17) float16 files rounded it away (held-out KL 0.97 -> 2.35 nats) and an AdamW step of
    # lr moved it r times further, relatively, than at the identity (2e-5: training KL 0.5 -> 283 nats in a step).
    stream_rms = (energy / max(seen, 1)).sqrt()  # [L]
    maps = maps * stream_rms[:, None, None]
    eye = torch.eye(D, dtype=torch.float64)
    for l, translator in enumerate(lens.layer_translators):
        translator.weight.copy_((maps[l, :D].T - eye).to(translator.weight.dtype))
        if translator.bias is not None:
            translator.bias.copy_(maps[l, D].to(translator.bias.dtype))
    return lens


def _accumulate(model, lens, hidden_LND: Tensor, final_ND: Tensor, chunk_tokens: int,
                tokens_per_step: int, precision: str = "float32") -> Tensor:
    """Adds each layer's KL gradient for these positions (weighted by their share of the step); returns the
    summed KL of each layer over them, divided by the step's size (so the step's values add up to its mean)."""
    L, N, _ = hidden_LND.shape
    kl_L = torch.zeros(L)
    for start in range(0, N, chunk_tokens):
        final_nD = final_ND[start:start + chunk_tokens]
        with torch.no_grad():
            final_logprobs = model.logits_from_resid(final_nD[None])[0].float().log_softmax(-1)
            final_terms = final_kl_terms(final_logprobs)  # the same for every layer
        weight = final_nD.shape[0] / tokens_per_step
        for l in range(L):
            with torch.enable_grad(), torch.autocast(hidden_LND.device.type, dtype=torch.bfloat16,
                                                     enabled=precision == "bfloat16"):
                lens_logits = model.logits_from_resid(lens.transform_hidden(hidden_LND[l, start:start + chunk_tokens],
                                                                            l)[None])[0]
            with torch.enable_grad():
                loss = kl_to_final(lens_logits, final_logprobs, final_terms) * weight
                loss.backward()
            kl_L[l] += float(loss.detach())
    return kl_L


def _order(n: int, seed: int) -> Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


