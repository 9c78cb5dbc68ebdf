"""SAEBench 0.6's feature absorption on the first-letter task (``sae_bench/evals/absorption``), per seed and with
the spread over seeds.

Legend: N flattened tokens, i d_in, X d_sae.

Here each row of an ``N`` axis is one word (its token in its prompt).

SAEBench's steps, with its defaults:

- the words are the tokenizer's single tokens made of letters (a leading space allowed, ``get_alpha_tokens``);
  each is asked about in an in-context prompt: ``ICL_EXAMPLES`` other words of its split, each as
  ``"{word} has the first letter: {L}"``, joined by newlines (one before the first), then
  ``"{word} has the first letter:"``; the activation is read at the word's token (SAEBench's
  ``prompt_token_pos=-6`` for GPT-2's tokens of the template; here counted from the template's own tokens);
- the vocabulary is split 80 / 20 (``train_test_fraction``); a probe per letter (one against the rest,
  ``experiments.probes.fit_logistic``, scikit-learn's objective, ``C=1``) on the train words' activations is the
  ground truth: its score above 0 is "the model knows the word starts with L"; its F1 on the test words must exceed
  ``MIN_PROBE_F1`` (0.6) for the letter to count;
- k-sparse probes on the latents, k = 1 .. ``MAX_K`` (10): the letter's main latents are the first k's latents
  while F1 on the test words rises by more than ``F1_JUMP_THRESHOLD`` (0.03) from k - 1 (``add_feature_splits``);
  ``num_split_features`` is their count;
- for each test word of the letter the probe calls right, with ``a`` its activation, ``d`` the probe's unit
  direction, ``cos_x`` the cosine of ``d`` with latent x's decoder row and ``p_x = f_x * cos_x`` (``f_x`` the
  latent's activation): ``absorption_fraction`` (``FeatureAbsorptionCalculator``) is 0 when the main latents'
  ``sum p_main >= a.d`` or when the (at most 3) largest positive ``p_x`` of the other latents with
  ``cos_x >= 0.1`` sum to less than 0.4 of ``a.d``; else 1 when ``sum p_main <= 0``; else
  ``min(absorbed, a.d - sum p_main) / (that + sum p_main)``. Full absorption: no main latent fires, the latent of
  largest ``p_x`` has ``cos >= 0.025``, ``a.d >= 0`` and that latent's ``p_x`` is at least 0.4 of ``a.d``;
- per letter ``mean_absorption_fraction`` = the fractions' sum / the probe's true positives, and
  ``full_absorption_rate`` = full absorptions / true positives; the measures are their means over the letters that
  count (``mean_absorption_fraction_score``, ``mean_full_absorption_score``, ``mean_num_split_features``).

Two departures, because the workbench has one logistic regression (``experiments.probes``: L2, no class weights):
SAEBench picks a k-sparse probe's latents by the largest weights of an L1-penalised probe on every latent; here by
the largest (signed) class-mean difference, SAEBench's own rule of sparse probing; and where SAEBench weights the
classes ("balanced"), here the letter's train words are fitted against as many others drawn evenly.
A seed draws the vocabulary's split, the in-context examples and those negatives.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Sequence

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from experiments._depth import stop_at_layer_for
from experiments._progress import Progress, ProgressArg
from experiments.probes import fit_logistic
from experiments.sae.bench.sparse_probing import one_against_rest
from workbench.errors import InputError
from workbench.sae import SAE

LETTERS = "abcdefghijklmnopqrstuvwxyz"
PROMPT_TEMPLATE = "{word} has the first letter:"
ICL_EXAMPLES = 10
TRAIN_FRACTION = 0.8
MAX_K = 10
F1_JUMP_THRESHOLD = 0.03
MIN_PROBE_F1 = 0.6
FULL_ABSORPTION_COS = 0.025
FRACTION_COS = 0.1
PROJECTION_PROPORTION = 0.4
MAX_ABSORBING_LATENTS = 3
EPS = 1e-8
MEASURES = ("mean_absorption_fraction_score", "mean_full_absorption_score", "mean_num_split_features",
            "n_letters")
ENGINE = "workbench-saebench-absorption-1"


def alpha_words(model, max_words: int = 1500) -> list[str]:
    """The tokenizer's tokens made only of ASCII letters (one leading space allowed) that encode back to
    themselves, at most ``max_words`` of them spread evenly over the vocabulary.

    Example:
        >>> words = alpha_words(model, max_words=5); len(words), all(w.strip().isalpha() for w in words)
        (5, True)
    """
    tokenizer = model.tokenizer
    words = []
    for index in range(tokenizer.vocab_size):
        text = tokenizer.decode([index])
        bare = text[1:] if text.startswith(" ") else text
        if bare and all(c in LETTERS or c in LETTERS.upper() for c in bare) \
                and tokenizer.to_tokens(text, prepend_bos=False)[0].tolist() == [index]:
            words.append(text)
    if len(words) > max_words:
        words = [words[i * len(words) // max_words] for i in range(max_words)]
    return words


def first_letter_prompt(word: str, examples: Sequence[str]) -> str:
    """SAEBench's in-context prompt for ``word`` (``create_icl_prompt`` with the first-letter answer).

    Example:
        >>> first_letter_prompt(" cat", [" dog", "Bee"])
        '\\n dog has the first letter: D\\nBee has the first letter: B\\n cat has the first letter:'
    """
    shots = [PROMPT_TEMPLATE.format(word=e) + " " + e.strip()[0].upper() for e in examples]
    return "\n" + "\n".join([*shots, PROMPT_TEMPLATE.format(word=word)])


def f1_score(predicted_N: Tensor, truth_N: Tensor) -> float:
    """F1 of boolean predictions (0 when nothing is predicted or true), as scikit-learn's ``f1_score``.

    Example:
        >>> f1_score(torch.tensor([True, True, False, False]), torch.tensor([True, False, True, False]))
        0.5
    """
    tp = int((predicted_N & truth_N).sum())
    denominator = int(predicted_N.sum()) + int(truth_N.sum())
    return 2 * tp / denominator if denominator else 0.0


def absorption_fraction(probe_projection: float, latent_projection_X: Float[Tensor, "X"], cos_X: Float[Tensor, "X"],
                        main: Sequence[int]) -> float:
    """SAEBench's absorption fraction of one word (see the module).

    Example (the main latent carries 1 of the probe projection 4, another aligned latent 2.5 of it):
        >>> absorption_fraction(4.0, torch.tensor([1.0, 2.5, 0.0]), torch.tensor([0.9, 0.5, 0.0]), [0])
        0.7142857142857143
    """
    main_projection = float(latent_projection_X[list(main)].sum()) if len(main) else 0.0
    candidates = torch.ones(len(latent_projection_X), dtype=torch.bool)
    candidates[list(main)] = False
    candidates &= (cos_X >= FRACTION_COS) & (latent_projection_X > 0)
    values = latent_projection_X[candidates]
    absorbed = float(values.topk(min(MAX_ABSORBING_LATENTS, values.numel())).values.sum())
    if main_projection >= probe_projection or absorbed / probe_projection < PROJECTION_PROPORTION:
        return 0.0
    if main_projection <= 0.0:
        return 1.0
    absorbed = min(absorbed, probe_projection - main_projection)
    return min(max(absorbed / (absorbed + main_projection), 0.0), 1.0)


def is_full_absorption(probe_projection: float, latents_X: Float[Tensor, "X"], cos_X: Float[Tensor, "X"],
                       main: Sequence[int]) -> bool:
    """SAEBench's full absorption of one word (see the module).

    Example (the main latent is silent; latent 1 carries 3 of the projection 4 at cosine 0.5):
        >>> is_full_absorption(4.0, torch.tensor([0.0, 6.0]), torch.tensor([0.9, 0.5]), [0])
        True
    """
    if not all(float(latents_X[m]) < EPS for m in main):
        return False
    projection_X = latents_X * cos_X
    top = int(projection_X.argmax())
    if float(cos_X[top]) < FULL_ABSORPTION_COS or probe_projection < 0:
        return False
    return float(projection_X[top]) / probe_projection >= PROJECTION_PROPORTION


@torch.no_grad()
def word_activations(model, sae: SAE, prompts: Sequence[str], batch_size: int = 32, progress: ProgressArg = False
                     ) -> tuple[Float[Tensor, "N i"], Float[Tensor, "N X"]]:
    """The activation at ``sae``'s hook on each prompt's word token (the token before the template's end) and its
    latents.

    Example:
        >>> sae = wb.load_sae("toy-attn-2l-resid1-topk")
        >>> acts, latents = word_activations(model, sae, [first_letter_prompt(" cat", [" dog"])])
        >>> acts.shape, latents.shape
        (torch.Size([1, 128]), torch.Size([1, 512]))
    """
    tail = len(model.tokenizer.to_tokens(PROMPT_TEMPLATE.format(word=""), prepend_bos=False)[0])
    acts, latents = [], []
    with Progress(progress, total=len(prompts), desc="SAEBench absorption: activations") as bar:
        for start in range(0, len(prompts), batch_size):
            tokens, mask = model.tokenizer.to_tokens_and_mask(list(prompts[start:start + batch_size]),
                                                             padding_side="right")
            position_B = mask.sum(1) - 1 - tail
            _, cache = model.run_with_cache(tokens.to(model.cfg.device), names_filter=[sae.cfg.hook_name],
                                            stop_at_layer=stop_at_layer_for(model, [sae.cfg.hook_name]),
                                            return_type=None)
            x_Bi = cache[sae.cfg.hook_name][torch.arange(len(tokens)), position_B.to(tokens.device)]
            x_Bi = x_Bi.to(sae.cfg.torch_dtype)
            acts.append(x_Bi.float().cpu())
            latents.append(sae.encode(x_Bi).float().cpu())
            bar.advance(len(tokens))
    return torch.cat(acts), torch.cat(latents)


def main_latents(latents_NX: Float[Tensor, "N X"], positive_N: Tensor, train_N: Tensor, test_N: Tensor,
                 generator: torch.Generator, max_k: int = MAX_K) -> list[int]:
    """A letter's main latents: the k-sparse probes' latents (largest class-mean difference) for k = 1, 2, ... while
    each k's test F1 beats the previous best by more than ``F1_JUMP_THRESHOLD``.

    Example (latent 1 alone is the letter):
        >>> positive = torch.tensor([True, False] * 10)
        >>> latents = torch.stack([torch.rand(20, generator=torch.Generator().manual_seed(0)), positive.float()], 1)
        >>> main_latents(latents, positive, torch.arange(12), torch.arange(12, 20), torch.Generator(), max_k=2)
        [1]
    """
    labels_N = positive_N.long()
    rows, binary = one_against_rest(labels_N, train_N, 1, generator)
    difference_X = latents_NX[rows][binary == 1].mean(0) - latents_NX[rows][binary == 0].mean(0)
    order = torch.argsort(difference_X, descending=True, stable=True)  # signed: latents that fire for the letter
    best, chosen = -100.0, []
    for k in range(1, min(max_k, latents_NX.shape[1]) + 1):
        columns = order[:k]
        probe = fit_logistic(latents_NX[rows][:, columns], binary, C=1.0)
        f1 = f1_score(probe.score(latents_NX[test_N][:, columns]) > 0, positive_N[test_N])
        if f1 <= best + F1_JUMP_THRESHOLD:
            break
        best, chosen = f1, columns.tolist()
    return chosen


def absorption_pass(model, sae: SAE, words: Sequence[str], seed: int, batch_size: int = 32,
                    progress: ProgressArg = False) -> dict[str, Any]:
    """One seed's absorption measures (``MEASURES``) on ``words``, and ``per_letter`` (letter -> its
    ``mean_absorption_fraction``, ``full_absorption_rate``, ``num_split_features``, ``probe_f1``, ``true_positives``).

    Example:
        >>> result = absorption_pass(model, wb.load_sae("toy-attn-2l-resid1-topk"), alpha_words(model, 60), seed=0)
        >>> sorted(result)[-2:]  # the toy model, trained on code, does not know first letters: n_letters is 0
        ['n_letters', 'per_letter']
    """
    shuffled = random.Random(seed).sample(list(words), len(words))
    cut = int(len(shuffled) * TRAIN_FRACTION)
    splits = {"train": shuffled[:cut], "test": shuffled[cut:]}
    sampler = random.Random(seed + 1)
    ordered, prompts = [], []
    for split in ("train", "test"):
        pool = splits[split]
        for word in pool:
            others = [w for w in pool if w != word]
            ordered.append(word)
            prompts.append(first_letter_prompt(word, sampler.sample(others, min(ICL_EXAMPLES, len(others)))))
    acts_Ni, latents_NX = word_activations(model, sae, prompts, batch_size, progress)
    letter_N = torch.tensor([LETTERS.index(w.strip()[0].lower()) for w in ordered])
    per_letter = letter_absorption(acts_Ni, latents_NX, sae.W_dec.detach().float().cpu(), letter_N, cut, seed)
    return {**summarise(per_letter), "per_letter": per_letter}


def letter_absorption(acts_Ni: Float[Tensor, "N i"], latents_NX: Float[Tensor, "N X"],
                      decoder_Xi: Float[Tensor, "X i"], letter_N: Int[Tensor, "N"], n_train: int,
                      seed: int) -> dict[str, dict[str, float]]:
    """Each letter's absorption on words whose activations, latents and first letters (indices into ``LETTERS``)
    are given, the first ``n_train`` rows being the train words: its ground-truth probe's test F1, its main latents'
    count, the probe's true positives and their mean absorption fraction and full-absorption rate.

    Example (one direction per letter; latent 0 is letter a's, latent 1 letter b's):
        >>> letters = torch.tensor([0, 1] * 10); acts = torch.nn.functional.one_hot(letters, 4).float() * 3
        >>> result = letter_absorption(acts, acts[:, :2], torch.eye(4)[:2], letters, 12, seed=0)
        >>> result["a"]["probe_f1"], result["a"]["num_split_features"], result["a"]["mean_absorption_fraction"]
        (1.0, 1, 0.0)
    """
    train_N, test_N = torch.arange(n_train), torch.arange(n_train, len(letter_N))
    generator = torch.Generator().manual_seed(int(seed))
    per_letter = {}
    for index, letter in enumerate(LETTERS):
        positive_N = letter_N == index
        if int(positive_N[train_N].sum()) < 2 or int(positive_N[test_N].sum()) < 1:
            continue  # too few words of the letter to fit or to test
        probe = fit_logistic(acts_Ni[train_N], positive_N[train_N].long(), C=1.0)
        probe_score_N = probe.score(acts_Ni)
        probe_f1 = f1_score(probe_score_N[test_N] > 0, positive_N[test_N])
        main = main_latents(latents_NX, positive_N, train_N, test_N, generator)
        direction_i = probe.weight[0] / probe.weight[0].norm()
        cos_X = torch.nn.functional.cosine_similarity(direction_i[None], decoder_Xi, dim=-1)
        true_positives = [int(n) for n in test_N if positive_N[n] and probe_score_N[n] > 0]
        fractions, full = 0.0, 0
        for n in true_positives:
            projection = float(acts_Ni[n] @ direction_i)
            fractions += absorption_fraction(projection, latents_NX[n] * cos_X, cos_X, main)
            full += is_full_absorption(projection, latents_NX[n], cos_X, main)
        count = len(true_positives)
        per_letter[letter] = {"mean_absorption_fraction": fractions / count if count else float("nan"),
                              "full_absorption_rate": full / count if count else float("nan"),
                              "num_split_features": len(main), "probe_f1": probe_f1, "true_positives": count}
    return per_letter


def summarise(per_letter: dict[str, dict[str, float]]) -> dict[str, float]:
    """The means over the letters whose probe's F1 exceeds ``MIN_PROBE_F1`` (NaN, and ``n_letters`` 0, when none
    does: the model does not know first letters at that hook).

    Example:
        >>> summarise({"a": {"mean_absorption_fraction": 0.5, "full_absorption_rate": 0.25, "num_split_features": 1,
        ...                  "probe_f1": 0.9}, "b": {"probe_f1": 0.1}})["mean_absorption_fraction_score"]
        0.5
    """
    counted = [r for r in per_letter.values() if r["probe_f1"] > MIN_PROBE_F1]
    result: dict[str, float] = {"n_letters": len(counted)}
    for measure, name in (("mean_absorption_fraction_score", "mean_absorption_fraction"),
                          ("mean_full_absorption_score", "full_absorption_rate"),
                          ("mean_num_split_features", "num_split_features")):
        result[measure] = sum(r[name] for r in counted) / len(counted) if counted else float("nan")
    return result
    return result


def absorption_metrics(model, sae: SAE, seeds: Sequence[int] = (0, 1, 2), max_words: int = 1500,
                       batch_size: int = 32, use_disk: bool = True, progress: ProgressArg = True) -> pd.DataFrame:
    """SAEBench 0.6's first-letter absorption of ``sae`` over ``seeds`` (at most ``max_words`` words of the
    tokenizer): one row per measure (``MEASURES``, index ``measure``), ``value`` (mean over seeds), ``std`` and
    ``seed_<s>``; ``table.attrs["per_letter"]`` holds each seed's per-letter results. Cached on disk per seed.

    Example:
        >>> table = absorption_metrics(model, wb.load_sae("toy-attn-2l-resid1-topk"), seeds=(0,), max_words=60,
        ...                            use_disk=False, progress=False)
        >>> list(table.index)[:2]
        ['mean_absorption_fraction_score', 'mean_full_absorption_score']
    """
    from experiments.corpus_windows import weights_digest
    from experiments.features.corpus import sae_digest
    from experiments.sae.bench.core import check_seeds
    from experiments.sae.bench.store import per_seed, spread_table
    from experiments.sae.inputs import check_hook

    seeds = check_seeds(seeds)
    if not isinstance(sae, SAE):
        raise InputError(f"sae must be a wb.SAE (wb.load_sae or train_sae), got {type(sae).__name__}")
    check_hook(model, sae.cfg.hook_name, "sae.cfg.metadata.hook_name")
    if isinstance(max_words, bool) or not isinstance(max_words, int) or max_words < 10:
        raise InputError(f"max_words must be an integer of at least 10, got {max_words!r}")
    words = alpha_words(model, max_words)
    if len({w.strip()[0].lower() for w in words}) < 2:
        raise InputError(f"the tokenizer has too few single-token words ({len(words)}) for the first-letter task")

    def key_of(seed: int) -> dict[str, Any]:
        return {"engine": ENGINE, "model": weights_digest(model), "sae": sae_digest(sae),
                "words": hashlib.sha256("\n".join(words).encode()).hexdigest(), "seed": seed}

    results = per_seed("absorption", key_of, seeds, (*MEASURES, "per_letter"),
                       lambda seed: absorption_pass(model, sae, words, seed, batch_size, progress), use_disk)
    table = spread_table(seeds, results, MEASURES)
    table.attrs["per_letter"] = [result["per_letter"] for result in results]
    return table
