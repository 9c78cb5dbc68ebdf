"""SAEBench 0.6's sparse probing (``sae_bench/evals/sparse_probing``): top-k-latent probes against probes on the
raw activation, on labelled text (``experiments.datasets.labelled``), per seed and with the spread over seeds.

Legend: N flattened tokens, B batch, P position, i d_in, X d_sae.

Here each row of an ``N`` axis is one text (its tokens pooled).

SAEBench's steps, with its defaults:

- each text is cut to ``context_length`` (128) tokens; its activation at the SAE's hook and its SAE latents are
  averaged over the positions that are not BOS / EOS / padding (``create_meaned_model_activations``,
  ``get_sae_meaned_activations``);
- each class is one binary task against the others (``prepare_probe_data``): every row of the class, and as
  many rows drawn from the other classes (``ceil(n / (classes - 1))`` from each, then ``n`` of those), in train
  and in test alike;
- the ``k`` inputs kept (``get_top_k_mean_diff_mask``) are those with the largest |mean over the class - mean over
  the others| on the train rows; a logistic probe with scikit-learn's objective and ``C=1``
  (``experiments.probes.fit_logistic``) is fitted on them, for ``k`` in ``K_VALUES`` (1, 2, 5), on the raw
  activation (``llm_top_k``) and on the latents (``sae_top_k``); ``llm`` / ``sae`` without k use every input
  (SAEBench fits those two by Adam on a GPU; here the same objective as the others);
- the measure is the held-out accuracy averaged over the classes; each task's rows come with the mean over tasks.

A seed draws the train / test split (``stratified_split``, ``test_fraction``) and the negatives, so the spread
over seeds is the split's noise.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Sequence, Union

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from experiments._depth import stop_at_layer_for
from experiments._progress import Progress, ProgressArg
from experiments.datasets.labelled import LabelledTexts, labelled_texts
from experiments.probes import accuracy, fit_logistic, stratified_split, top_k_mean_diff
from experiments.sae.activations import special_token_ids
from experiments.sae.inputs import check_hook
from workbench.errors import InputError
from workbench.sae import SAE

K_VALUES = (1, 2, 5)  # SAEBench 0.6's default k_values
TASKS = ("language", "code_vs_prose", "handbook_chapter")
CONTEXT_LENGTH = 128
ENGINE = "workbench-saebench-sparse-probing-1"  # the cache's format


def _measure_names(k_values: Sequence[int] = K_VALUES) -> tuple[str, ...]:
    """SAEBench's keys: the full probes' and the top-k probes' test accuracy.

    Example:
        >>> _measure_names((1,))
        ('llm_test_accuracy', 'llm_top_1_test_accuracy', 'sae_test_accuracy', 'sae_top_1_test_accuracy')
    """
    return ("llm_test_accuracy", *(f"llm_top_{k}_test_accuracy" for k in k_values),
            "sae_test_accuracy", *(f"sae_top_{k}_test_accuracy" for k in k_values))


def one_against_rest(labels_N: Int[Tensor, "N"], rows_N: Int[Tensor, "N"], positive: int,
                     generator: torch.Generator) -> tuple[Int[Tensor, "N"], Int[Tensor, "N"]]:
    """SAEBench's ``prepare_probe_data``: the rows (of ``rows_N``) of class ``positive`` and as many others drawn
    evenly from the other classes, with binary labels (1 = the class), shuffled.

    Example:
        >>> rows, binary = one_against_rest(torch.tensor([0, 0, 1, 1, 2, 2]), torch.arange(6), 0,
        ...                                 torch.Generator().manual_seed(0))
        >>> len(rows), int(binary.sum()), sorted(rows[binary == 1].tolist())
        (4, 2, [0, 1])
    """
    labels_N = torch.as_tensor(labels_N)
    positives = rows_N[labels_N[rows_N] == positive]
    others = [c for c in torch.unique(labels_N[rows_N]).tolist() if c != positive]
    per_class = math.ceil(len(positives) / len(others))
    drawn = []
    for other in others:
        pool = rows_N[labels_N[rows_N] == other]
        drawn.append(pool[torch.randperm(len(pool), generator=generator)[:per_class]])
    negatives = torch.cat(drawn)
    negatives = negatives[torch.randperm(len(negatives), generator=generator)[:len(positives)]]
    rows = torch.cat([positives, negatives])
    binary = torch.cat([torch.ones(len(positives), dtype=torch.long), torch.zeros(len(negatives), dtype=torch.long)])
    order = torch.randperm(len(rows), generator=generator)
    return rows[order], binary[order]


@torch.no_grad()
def pooled_activations(model, sae: SAE, texts: Sequence[str], context_length: int = CONTEXT_LENGTH,
                       batch_size: int = 16, progress: ProgressArg = False
                       ) -> tuple[Float[Tensor, "N i"], Float[Tensor, "N X"]]:
    """Each text's activation at ``sae``'s hook and its SAE latents, averaged over its first ``context_length``
    tokens that are not BOS / EOS / padding.

    Example:
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=4,
        ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.ones(128, 4),
        ...     "W_dec": torch.zeros(4, 128), "b_enc": torch.zeros(4), "b_dec": torch.zeros(128)})
        >>> acts, latents = pooled_activations(model, sae, ["a cat", "the dog ran"])
        >>> acts.shape, latents.shape
        (torch.Size([2, 128]), torch.Size([2, 4]))
    """
    special = torch.tensor(special_token_ids(model), dtype=torch.long)
    acts, latents = [], []
    with Progress(progress, total=len(texts), desc="SAEBench sparse probing: activations") as bar:
        for start in range(0, len(texts), batch_size):
            tokens, mask = model.tokenizer.to_tokens_and_mask(list(texts[start:start + batch_size]),
                                                             padding_side="right")
            tokens, mask = tokens[:, :context_length], mask[:, :context_length].bool()
            keep_BP = mask & ~torch.isin(tokens, special)
            if not keep_BP.any(1).all():
                raise InputError("a labelled text has no token besides BOS / EOS / padding")
            _, cache = model.run_with_cache(tokens.to(model.cfg.device), names_filter=[sae.cfg.hook_name],
                                            stop_at_layer=stop_at_layer_for(model, [sae.cfg.hook_name]),
                                            return_type=None)
            x_BPi = cache[sae.cfg.hook_name].to(sae.cfg.torch_dtype)
            weight_BP1 = keep_BP.to(x_BPi.device, torch.float32)[..., None]
            count_B1 = weight_BP1.sum(1)
            acts.append(((x_BPi.float() * weight_BP1).sum(1) / count_B1).cpu())
            latents.append(((sae.encode(x_BPi).float() * weight_BP1).sum(1) / count_B1).cpu())
            bar.advance(tokens.shape[0])
    return torch.cat(acts), torch.cat(latents)


def probing_pass(acts_Ni: Float[Tensor, "N i"], latents_NX: Float[Tensor, "N X"], labels_N: Int[Tensor, "N"],
                 seed: int, k_values: Sequence[int] = K_VALUES, test_fraction: float = 0.2) -> dict[str, float]:
    """One seed's sparse probing of one labelled set: each of ``_measure_names(k_values)``, the held-out accuracy
    averaged over the classes (each one against the rest).

    Example (latent 0 is the label, the raw activation is noise: the top-1 latent probe is exact):
        >>> labels = torch.tensor([0, 1] * 10); noise = torch.randn(20, 3, generator=torch.Generator().manual_seed(0))
        >>> result = probing_pass(noise, torch.stack([labels.float(), torch.zeros(20)], 1), labels, seed=0, k_values=(1,))
        >>> result["sae_top_1_test_accuracy"]
        1.0
    """
    labels_N = torch.as_tensor(labels_N)
    train_N, test_N = stratified_split(labels_N, test_fraction, seed)
    generator = torch.Generator().manual_seed(int(seed))
    scores: dict[str, list[float]] = {name: [] for name in _measure_names(k_values)}
    for positive in torch.unique(labels_N).tolist():
        train_rows, train_y = one_against_rest(labels_N, train_N, positive, generator)
        test_rows, test_y = one_against_rest(labels_N, test_N, positive, generator)
        for prefix, inputs in (("llm", acts_Ni), ("sae", latents_NX)):
            for k in (None, *k_values):
                columns = (torch.arange(inputs.shape[1]) if k is None
                           else top_k_mean_diff(inputs[train_rows], train_y, k))
                probe = fit_logistic(inputs[train_rows][:, columns], train_y, C=1.0)
                name = f"{prefix}_test_accuracy" if k is None else f"{prefix}_top_{k}_test_accuracy"
                scores[name].append(accuracy(probe.predict(inputs[test_rows][:, columns]), test_y))
    return {name: sum(values) / len(values) for name, values in scores.items()}


def _check_k_values(k_values: Any, widths: dict[str, int]) -> tuple[int, ...]:
    """``k_values`` as a tuple of positive integers no larger than every width in ``widths``, else ``InputError``.

    Example:
        >>> _check_k_values([1, 2], {"d_sae": 4})
        (1, 2)
    """
    if isinstance(k_values, (str, bytes)) or not isinstance(k_values, Sequence) or not k_values:
        raise InputError(f"k_values must be a non-empty sequence of positive integers, got {k_values!r}")
    for k in k_values:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InputError(f"k_values must hold positive integers, got {k!r}")
        for name, width in widths.items():
            if k > width:
                raise InputError(f"k={k} is larger than {name}={width}: a top-k probe cannot keep more inputs "
                                 "than there are")
    return tuple(k_values)


def _labelled_sets(tasks: Sequence[Union[str, LabelledTexts]], per_class: int) -> list[LabelledTexts]:
    """Each task as ``LabelledTexts`` (a name is read by ``labelled_texts``), checked to have two classes with two
    texts each (a held-out split needs them).

    Example:
        >>> [s.task for s in _labelled_sets([LabelledTexts("mine", ("a", "b", "c", "d"), (0, 0, 1, 1), ("x", "y"))], 10)]
        ['mine']
    """
    if isinstance(tasks, (str, LabelledTexts)) or not isinstance(tasks, Sequence) or not tasks:
        raise InputError(f"tasks must be a non-empty sequence of task names or LabelledTexts, got {tasks!r}")
    sets = []
    for task in tasks:
        data = labelled_texts(task, per_class=per_class) if isinstance(task, str) else task
        if not isinstance(data, LabelledTexts):
            raise InputError(f"a task must be a name in {TASKS} or LabelledTexts, got {type(task).__name__}")
        counts = torch.bincount(torch.tensor(data.labels, dtype=torch.long))
        present = counts[counts > 0]
        if len(present) < 2:
            raise InputError(f"labelled set {data.task!r} has one class ({data.classes}); probing needs two or more")
        if int(present.min()) < 2:
            raise InputError(f"labelled set {data.task!r} has a class with one text; each class needs two or more")
        sets.append(data)
    return sets


def _data_digest(data: LabelledTexts) -> str:
    """A digest of a labelled set's texts and labels (its cache key).

    Example:
        >>> len(_data_digest(LabelledTexts("t", ("a",), (0,), ("x",))))
        64
    """
    return hashlib.sha256(repr((data.texts, data.labels, data.classes)).encode()).hexdigest()


def _with_task_means(result_by_task: dict[str, dict[str, float]], k_values: Sequence[int]) -> dict[str, float]:
    """One seed's flat result: ``task/measure`` for each task, and each measure's mean over the tasks.

    Example:
        >>> flat = _with_task_means({"a": {"llm_test_accuracy": 1.0, "sae_test_accuracy": 0.5},
        ...                         "b": {"llm_test_accuracy": 0.5, "sae_test_accuracy": 0.5}}, ())
        >>> flat["llm_test_accuracy"], flat["b/llm_test_accuracy"]
        (0.75, 0.5)
    """
    flat = {f"{task}/{name}": value for task, result in result_by_task.items() for name, value in result.items()}
    for name in _measure_names(k_values):
        values = [result[name] for result in result_by_task.values()]
        flat[name] = sum(values) / len(values)
    return flat


def _as_frame(table: pd.DataFrame) -> pd.DataFrame:
    """The table with a ``task`` column (``"mean"`` for the means over tasks).

    Example:
        >>> _as_frame(pd.DataFrame({"value": [1.0]}, index=pd.Index(["t/x"], name="measure")))["task"].tolist()
        ['t']
    """
    table = table.copy()
    table.insert(0, "task", [name.split("/")[0] if "/" in name else "mean" for name in table.index])
    return table


def sparse_probing_metrics(model, sae: SAE, tasks: Sequence[Union[str, LabelledTexts]] = TASKS,
                           seeds: Sequence[int] = (0, 1, 2), k_values: Sequence[int] = K_VALUES,
                           per_class: int = 200, test_fraction: float = 0.2, context_length: int = CONTEXT_LENGTH,
                           batch_size: int = 16, use_disk: bool = True, progress: ProgressArg = True) -> pd.DataFrame:
    """SAEBench 0.6's sparse probing of ``sae`` on labelled ``tasks`` (names in ``TASKS``, read with at most
    ``per_class`` texts per class, or ``LabelledTexts``): one row per measure (index ``measure``; ``task/measure``
    per task, the bare name for the mean over tasks), column ``task``, ``value`` (mean over seeds), ``std`` and
    ``seed_<s>``. Each seed's result is cached on disk per model, SAE, data and settings.

    Example:
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=256,
        ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.cat([torch.eye(128), -torch.eye(128)], 1),
        ...     "W_dec": torch.cat([torch.eye(128), -torch.eye(128)]), "b_enc": torch.zeros(256), "b_dec": torch.zeros(128)})
        >>> data = LabelledTexts("toy", ("def f(x): return x",) * 4 + ("The cat sat on the mat.",) * 4,
        ...                      (0,) * 4 + (1,) * 4, ("code", "prose"))
        >>> table = sparse_probing_metrics(model, sae, [data], seeds=(0, 1), k_values=(1,), use_disk=False,
        ...                                progress=False)
        >>> float(table.loc["llm_top_1_test_accuracy", "value"]), float(table.loc["toy/sae_top_1_test_accuracy", "std"])
        (1.0, 0.0)
    """
    from experiments.corpus_windows import weights_digest
    from experiments.features.corpus import sae_digest
    from experiments.sae.bench.core import check_seeds
    from experiments.sae.bench.store import per_seed, spread_table

    seeds = check_seeds(seeds)
    if not isinstance(sae, SAE):
        raise InputError(f"sae must be a wb.SAE (wb.load_sae or train_sae), got {type(sae).__name__}")
    check_hook(model, sae.cfg.hook_name, "sae.cfg.metadata.hook_name")
    k_values = _check_k_values(k_values, {"d_sae": sae.cfg.d_sae, "d_in": sae.cfg.d_in})
    if not 0 < test_fraction < 1:
        raise InputError(f"test_fraction must be between 0 and 1, got {test_fraction!r}")
    sets = _labelled_sets(tasks, per_class)
    pooled: dict[str, tuple[Tensor, Tensor]] = {}

    def compute(seed: int) -> dict[str, float]:
        by_task = {}
        for data in sets:
            if data.task not in pooled:
                pooled[data.task] = pooled_activations(model, sae, data.texts, context_length, batch_size, progress)
            acts, latents = pooled[data.task]
            by_task[data.task] = probing_pass(acts, latents, torch.tensor(data.labels), seed, k_values, test_fraction)
        return _with_task_means(by_task, k_values)

    def key_of(seed: int) -> dict[str, Any]:
        return {"engine": ENGINE, "model": weights_digest(model), "sae": sae_digest(sae),
                "data": [_data_digest(data) for data in sets],
                "settings": {"seed": seed, "k_values": list(k_values), "test_fraction": test_fraction,
                             "context_length": context_length}}

    names = list(_measure_names(k_values)) + [f"{d.task}/{n}" for d in sets for n in _measure_names(k_values)]
    results = per_seed("sparse_probing", key_of, seeds, names, compute, use_disk)
    return _as_frame(spread_table(seeds, results, names))
