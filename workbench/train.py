"""Training a ``Decoder`` on a token stream: AdamW, warmup then cosine decay, clipping, checkpoints.

Legend: B batch, P position, C copy length, N flattened tokens, E num_experts, k experts_per_token.

Every training sequence is BOS followed by P-1 consecutive tokens from a random offset of the
training stream (documents joined by the boundary token), so the model always sees the same
first token, as it will at inference (the zoo tokenizer prepends BOS). MoE models add a
Switch/Mixtral load-balancing loss read from ``mlp.hook_router_logits``; the Decoder itself is
unchanged.

``python -m experiments.zoo --recipe toy-attn-2l --out workbench/zoo/toy-attn-2l`` reproduces a
zoo model with this trainer (recipes: ``workbench.zoo.recipes``) and measures it for its card.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from workbench.errors import InputError
from workbench.model import Decoder
from workbench.tokenizer import Tokenizer

MIN_REPEAT_LEN = 8  # shortest stretch written twice, in repeated-text windows and in the induction task


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation hyper-parameters (the model's own live in its ``ModelConfig``).

    Example:
        >>> TrainConfig(steps=10, batch_size=2, seq_len=16).tokens_seen
        320
    """

    steps: int = 3000
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1  # on matrices only, not on norm gains or biases
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01  # load-balancing loss weight, MoE models only
    repeat_fraction: float = 0.0  # share of each batch whose window is a stretch of text written twice
    # Every induction_every-th step (0: never) trains on induction_batch rows of BOS + n random tokens
    # + the same n again instead of the corpus: the classic induction task. n is drawn per step from
    # induction_len_range, so no fixed look-back distance solves it (with one n, a head attending n-1
    # back would, without any induction).
    # The first induction_warmup_steps steps are all induction task (an induction circuit forms far
    # sooner without code competing for the gradient); after them, one step in induction_every.
    induction_every: int = 0
    induction_warmup_steps: int = 0
    induction_batch: int = 32
    induction_len: int = 100
    seed: int = 0
    eval_every: int = 500
    eval_windows: int = 256  # fixed windows for the train / held-out loss estimates
    checkpoint_every: int = 1000

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "eval_windows", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise InputError(f"TrainConfig.{name} must be a positive integer, got {getattr(self, name)}")
        if self.induction_every < 0 or self.induction_batch < 1 or self.induction_len < 1:
            raise InputError(f"TrainConfig: need induction_every >= 0, induction_batch >= 1, induction_len >= 1; got "
                             f"{self.induction_every}, {self.induction_batch}, {self.induction_len}")
        if not 0 <= self.induction_warmup_steps <= self.steps:
            raise InputError(f"TrainConfig.induction_warmup_steps must be in [0, steps={self.steps}], "
                             f"got {self.induction_warmup_steps}")
        if self.seq_len < 2:
            raise InputError(f"TrainConfig.seq_len must be at least 2 (BOS and one token), got {self.seq_len}")
        if not 0 <= self.repeat_fraction <= 1:
            raise InputError(f"TrainConfig.repeat_fraction must be in [0, 1], got {self.repeat_fraction}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.warmup_steps >= 0):
            raise InputError(f"TrainConfig: need lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0; got "
                             f"lr={self.lr}, min_lr_ratio={self.min_lr_ratio}, warmup_steps={self.warmup_steps}")

    @property
    def induction_steps(self) -> int:
        """How many steps train on the induction task rather than the corpus.

        Example:
            >>> TrainConfig(steps=10, induction_every=4, induction_warmup_steps=2).induction_steps   # 0, 1, 4, 8
            4
        """
        return sum(1 for step in range(self.steps) if self.is_induction_step(step))

    def is_induction_step(self, step: int) -> bool:
        """Whether ``step`` (from 0) trains on the induction task: every warmup step, then one in
        ``induction_every``.

        Example:
            >>> cfg = TrainConfig(steps=10, induction_every=4, induction_warmup_steps=2)
            >>> [step for step in range(cfg.steps) if cfg.is_induction_step(step)]
            [0, 1, 4, 8]
        """
        return step < self.induction_warmup_steps or bool(self.induction_every and step % self.induction_every == 0)

    @property
    def induction_len_range(self) -> tuple[int, int]:
        """The induction task's copy length n is drawn uniformly from ``low..high`` (both included).

        Example:
            >>> TrainConfig(induction_len=100).induction_len_range, TrainConfig(induction_len=5).induction_len_range
            ((8, 100), (5, 5))
        """
        return min(MIN_REPEAT_LEN, self.induction_len), self.induction_len

    @property
    def tokens_seen(self) -> int:
        """Corpus tokens plus the induction task's expected tokens (its copy length n is uniform in its range).

        Example:
            >>> cfg = TrainConfig(steps=2, batch_size=2, seq_len=16,
            ...                   induction_every=2, induction_batch=4, induction_len=8)
            >>> cfg.tokens_seen   # step 1: 2 x 16 corpus tokens; step 0, the induction task: 4 x (BOS + 8 + 8)
            100
        """
        mean_row = 1 + sum(self.induction_len_range)  # BOS + 2 x the mean copy length
        corpus_steps = self.steps - self.induction_steps
        return round(corpus_steps * self.batch_size * self.seq_len + self.induction_steps * self.induction_batch * mean_row)


@dataclass
class TrainResult:
    """What a run measured: the loss curve (every step), periodic evaluations and the wall time.

    Example:
        >>> TrainResult(evals=[{"step": 500, "held_out_loss": 4.2}]).final, TrainResult().final
        ({'step': 500, 'held_out_loss': 4.2}, {})
    """

    train_loss: list[float] = field(default_factory=list)  # per step, the batch's LM loss
    evals: list[dict] = field(default_factory=list)  # {"step", "train_loss", "held_out_loss"}
    wall_seconds: float = 0.0

    @property
    def final(self) -> dict:
        """The last evaluation (``{}`` before the first).

        Example:
            >>> TrainResult(evals=[{"step": 1}, {"step": 2}]).final
            {'step': 2}
        """
        return self.evals[-1] if self.evals else {}


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``cfg.lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio``.

    Example:
        >>> cfg = TrainConfig(steps=110, warmup_steps=10, lr=1.0, min_lr_ratio=0.0)
        >>> learning_rate(4, cfg), learning_rate(60, cfg), learning_rate(110, cfg)
        (0.5, 0.5, 0.0)
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def tokenize_documents(tokenizer: Tokenizer, texts: Sequence[str]) -> Int[Tensor, "n_tokens"]:
    """All texts as one stream of ids, each document followed by the EOS (boundary) token.

    Example:
        >>> tokenize_documents(model.tokenizer, ["a", "b"]).tolist()   # EOS is id 0
        [65, 0, 66, 0]
    """
    if tokenizer.eos_token_id is None:
        raise InputError("the tokenizer has no EOS token to separate documents with")
    encodings = tokenizer.backend.encode_batch(list(texts), add_special_tokens=False)
    ids: list[int] = []
    for encoding in encodings:
        ids.extend(encoding.ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(stream_N: Int[Tensor, "n_tokens"], batch: int, seq_len: int, bos: int,
                   generator: torch.Generator, repeated_rows: int = 0) -> Int[Tensor, "batch seq_len"]:
    """``batch`` rows of BOS + seq_len-1 consecutive stream tokens from uniformly random offsets.

    In the first ``repeated_rows`` rows a stretch of random length h (8 .. (seq_len-1)//2) is
    written twice and the text then carries on where the stretch ended: x[0:h] x[0:h] x[h:].
    Its second copy is predictable only by looking back to the first, and because h varies a
    fixed look-back distance does not help: it takes an induction head.

    Example:
        >>> rows = random_windows(torch.arange(100), 2, 33, bos=99, generator=torch.Generator().manual_seed(0),
        ...                       repeated_rows=1)
        >>> rows.shape, rows[1, 1:].diff().eq(1).all().item()
        (torch.Size([2, 33]), True)
    """
    span = seq_len - 1
    if stream_N.numel() <= span:
        raise InputError(f"the token stream ({stream_N.numel()} tokens) is shorter than one window ({span} + BOS)")
    starts_B = torch.randint(0, stream_N.numel() - span, (batch,), generator=generator)
    offsets_BP = torch.arange(span).repeat(batch, 1)
    if repeated_rows:
        low, high = min(MIN_REPEAT_LEN, span // 2), span // 2
        period_B1 = torch.randint(low, high + 1, (repeated_rows, 1), generator=generator)
        j_BP = offsets_BP[:repeated_rows]
        offsets_BP[:repeated_rows] = torch.where(j_BP < 2 * period_B1, j_BP % period_B1, j_BP - period_B1)
    body_BP = stream_N[starts_B[:, None] + offsets_BP]
    return torch.cat([torch.full((batch, 1), bos, dtype=torch.long), body_BP], dim=1)


def repeated_random_windows(d_vocab: int, batch: int, copy_len: int, bos: int,
                            generator: torch.Generator) -> Int[Tensor, "batch seq_len"]:
    """``batch`` rows of BOS + ``copy_len`` random tokens (never BOS) + the same tokens again.

    The classic induction task (Olsson et al. 2022): every token of the second copy is
    predictable only by finding its earlier occurrence and copying what followed it.

    Example:
        >>> rows = repeated_random_windows(50, 2, 5, bos=0, generator=torch.Generator().manual_seed(0))
        >>> rows.shape, rows[:, 0].tolist(), torch.equal(rows[:, 1:6], rows[:, 6:]), bool((rows[:, 1:] != 0).all())
        (torch.Size([2, 11]), [0, 0], True, True)
    """
    draw_BC = torch.randint(0, d_vocab - 1, (batch, copy_len), generator=generator)
    copy_BC = draw_BC + (draw_BC >= bos).long()  # skip the BOS id
    return torch.cat([torch.full((batch, 1), bos, dtype=torch.long), copy_BC, copy_BC], dim=1)


def fixed_windows(stream_N: Int[Tensor, "n_tokens"], seq_len: int, max_windows: int, bos: int) -> Int[Tensor, "windows seq_len"]:
    """Up to ``max_windows`` non-overlapping windows (BOS + seq_len-1 tokens) spread evenly over the stream.

    Example:
        >>> fixed_windows(torch.arange(100), 5, 3, bos=99)[:, :2].tolist()
        [[99, 0], [99, 48], [99, 96]]
    """
    span = seq_len - 1
    available = stream_N.numel() // span
    if available == 0:
        raise InputError(f"the token stream ({stream_N.numel()} tokens) is shorter than one window ({span} + BOS)")
    chosen = torch.linspace(0, available - 1, min(max_windows, available)).round().long().unique()
    body_BP = stream_N[chosen[:, None] * span + torch.arange(span)]
    return torch.cat([torch.full((len(chosen), 1), bos, dtype=torch.long), body_BP], dim=1)


@torch.no_grad()
def mean_loss(model: Decoder, windows_BP: Int[Tensor, "windows seq_len"], batch: int = 32) -> float:
    """Mean next-token loss over all windows (every predicted token weighs the same).

    Example:
        >>> round(mean_loss(model, tokens.repeat(3, 1), batch=2), 4)   # 3 windows, 2 at a time
        4.7025
        >>> round(model(tokens, return_type="loss").item(), 4)         # each is the same window
        4.7025
    """
    total, count = 0.0, 0
    for chunk in windows_BP.split(batch):
        losses = model(chunk, return_type="loss", loss_per_token=True)
        total, count = total + losses.sum().item(), count + losses.numel()
    return total / count


def load_balancing_loss(router_logits: Sequence[Float[Tensor, "batch pos n_experts"]], k: int) -> Tensor:
    """Switch-Transformer auxiliary loss, averaged over layers: E * sum_e f_e * p_e.

    f_e is the fraction of routing slots (tokens x k) sent to expert e, p_e its mean router
    probability; the loss is 1 when routing is uniform and grows as it concentrates. Only p_e
    carries a gradient (f_e comes from a top-k), as in Switch and Mixtral.

    Example:
        >>> round(load_balancing_loss([torch.zeros(1, 8, 4)], k=2).item(), 4)
        1.0
    """
    losses = []
    for logits_BPE in router_logits:
        E = logits_BPE.shape[-1]
        probs_NE = torch.softmax(logits_BPE.float().reshape(-1, E), dim=-1)
        chosen_NE = F.one_hot(probs_NE.topk(k, dim=-1).indices, E).sum(dim=1).float()
        fraction_E = chosen_NE.mean(0) / k
        losses.append(E * (fraction_E * probs_NE.mean(0)).sum())
    return torch.stack(losses).mean()


def _optimizer(model: Decoder, cfg: TrainConfig) -> torch.optim.AdamW:
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def train(model: Decoder, train_stream: Int[Tensor, "n_train"], held_out_stream: Int[Tensor, "n_held_out"],
          cfg: TrainConfig, out: Optional[Union[str, Path]] = None, bos: int = 0,
          progress: bool = True, on_eval: Optional[Callable[[Decoder], dict]] = None) -> TrainResult:
    """Trains ``model`` in place; saves it to ``out`` every ``checkpoint_every`` steps and at the end.

    The seed fixes the batches (the model's initialisation is the caller's: seed before building it).
    ``on_eval(model)`` may add measurements (e.g. induction scores) to each periodic evaluation.

    Example:
        >>> import inspect, shutil, tempfile, textwrap
        >>> stream = tokenize_documents(model.tokenizer, [inspect.getsource(textwrap)])   # one stdlib file
        >>> cfg = TrainConfig(steps=2, batch_size=2, seq_len=32, warmup_steps=1, eval_windows=2)
        >>> out = tempfile.mkdtemp()
        >>> result = train(model, stream[:-1000], stream[-1000:], cfg, out=out, progress=False)
        step 2: train_loss ..., held_out_loss ...
        >>> len(result.train_loss), result.final["step"]
        (2, 2)
        >>> wb.load_model(out).cfg.model_name   # the checkpoint written at the end
        'toy-attn-2l'
        >>> shutil.rmtree(out)
    """
    generator = torch.Generator().manual_seed(cfg.seed)
    train_eval = fixed_windows(train_stream, cfg.seq_len, cfg.eval_windows, bos)
    held_out_eval = fixed_windows(held_out_stream, cfg.seq_len, cfg.eval_windows, bos)
    optimizer = _optimizer(model, cfg)
    router_logits: list[Tensor] = []

    def capture_router_logits(logits_BPE: Tensor, hook) -> None:
        router_logits.append(logits_BPE)

    moe_hooks = [(f"blocks.{l}.mlp.hook_router_logits", capture_router_logits)
                 for l in range(model.cfg.n_layers)] if model.cfg.is_moe else []
    repeated_rows = round(cfg.batch_size * cfg.repeat_fraction)
    result, started = TrainResult(), time.perf_counter()

    def evaluate(step: int) -> None:
        model.eval()
        result.evals.append({"step": step, "train_loss": mean_loss(model, train_eval),
                             "held_out_loss": mean_loss(model, held_out_eval), **(on_eval(model) if on_eval else {})})
        model.train()

    model.train()
    with model.hooks(fwd_hooks=moe_hooks), tqdm(total=cfg.steps, desc="train", disable=not progress) as bar:
        for step in range(cfg.steps):
            lr = learning_rate(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if cfg.is_induction_step(step):
                low, high = cfg.induction_len_range
                copy_len = int(torch.randint(low, high + 1, (1,), generator=generator))
                tokens_BP = repeated_random_windows(model.cfg.d_vocab, cfg.induction_batch, copy_len, bos, generator)
            else:
                tokens_BP = random_windows(train_stream, cfg.batch_size, cfg.seq_len, bos, generator, repeated_rows)
            router_logits.clear()
            lm_loss = model(tokens_BP, return_type="loss")
            loss = lm_loss
            if router_logits:
                loss = loss + cfg.aux_loss_coef * load_balancing_loss(router_logits, model.cfg.experts_per_token)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            result.train_loss.append(lm_loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{lm_loss.item():.3f}", lr=f"{lr:.2e}", refresh=False)
            done = step + 1
            if done % cfg.eval_every == 0 or done == cfg.steps:
                router_logits.clear()
                evaluate(done)
                bar.write(f"step {done}: " + ", ".join(f"{key} {value:.4g}" for key, value in result.evals[-1].items()
                                                       if key != "step" and isinstance(value, float)))
            if out is not None and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
                model.save(out)
    router_logits.clear()
    model.eval()
    result.wall_seconds = time.perf_counter() - started
    return result
