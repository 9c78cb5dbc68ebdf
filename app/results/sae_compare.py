"""The SAE comparison page's results: which SAEs can be compared on the open model, SAEBench's core measures of
several of them at one hook (``experiments.sae.bench.run_bench``: per seed, cached on disk), the measures as a table
with their spreads, and the link that opens each SAE on the Features page.

The run is a ``LongRun`` (``app.results.long_runs``): kept in this process's store and drawn with one progress bar
over every SAE and seed; ``run_bench`` keeps each seed's result on disk, so a second run, in this process or after a
restart, costs no forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence
from urllib.parse import urlencode

import pandas as pd

import workbench as wb
from app.artifact_picker import A_PATH, PICKERS
from app.results.long_runs import LongRun, ProgressBar
from app.state import LoadedModel
from experiments.cli.sae import POOL_FACTOR, WINDOW, data_windows
from experiments.corpus_windows import default_corpus
from experiments.sae.bench import differs, run_bench

# Held-out text of the corpus each model was trained on (``default_corpus``: "code" for the zoo's toys).
HELD_OUT = {"code": "stdlib-held-out", "english": "english-held-out"}
DATA_CHOICES = ("stdlib-held-out", "english-held-out")
TOKEN_COUNTS = (256, 512, 1024, 2048, 4096)  # tokens per seed a page can ask for (a link cannot ask for more)
DEFAULT_TOKENS = 1024
MAX_SEEDS = 5
DEFAULT_SEEDS = 3
MAX_SAES = 8
MAX_PATH_CHARS = 1000
# The measures the page's table shows first, in SAEBench's order (the rest follow in ``MEASURES``' order).
HEADLINE = ("l0", "explained_variance", "ce_loss_score", "kl_div_score", "mse", "cossim", "l2_ratio", "frac_alive")
FRONTIER_Y = {"Explained variance": "explained_variance", "Loss recovered (CE-loss score)": "ce_loss_score",
              "KL-divergence score": "kl_div_score"}
FEATURES_PAGE = "Features"  # the Features page's URL path (app/pages/12_Features.py)


@dataclass(frozen=True)
class Candidate:
    """One SAE the page may compare: its ``label`` (unique on the page), the ``path`` it is opened from and the
    Features page's picker choice (``source``: the shipped label, or "a path on this machine")."""

    label: str
    path: str
    source: str


@dataclass(frozen=True)
class Compared:
    """An SAE opened for the comparison, with its artifact key (what results are cached under)."""

    candidate: Candidate
    key: str
    sae: Any = field(compare=False, repr=False)

    @property
    def hook(self) -> str:
        cfg = self.sae.cfg
        return cfg.hook_name if cfg.hook_name == cfg.hook_name_out else f"{cfg.hook_name} -> {cfg.hook_name_out}"


def default_data(model) -> str:
    """The held-out text of the corpus the model was trained on: ``stdlib-held-out`` for the zoo's toys,
    ``english-held-out`` for the others.

    Example:
        >>> default_data(model)
        'stdlib-held-out'
    """
    return HELD_OUT.get(default_corpus(model), "english-held-out")


def parse_paths(text: str) -> tuple[str, ...]:
    """The SAE directories typed one per line (blank lines dropped, repeats once), checked: at most ``MAX_SAES``,
    each under ``MAX_PATH_CHARS`` characters and without a NUL; an ``InputError`` names what is wrong.

    Example:
        >>> parse_paths(" /a/sae \\n\\n/b/sae\\n/a/sae")
        ('/a/sae', '/b/sae')
        >>> parse_paths("/a\\x00b")
        Traceback (most recent call last):
        workbench.errors.InputError: SAE path 1 holds a NUL character; give a directory path
    """
    paths = tuple(dict.fromkeys(line.strip() for line in (text or "").splitlines() if line.strip()))
    if len(paths) > MAX_SAES:
        raise wb.InputError(f"{len(paths)} SAE paths given; the page compares at most {MAX_SAES} SAEs")
    for number, path in enumerate(paths, 1):
        if "\x00" in path:
            raise wb.InputError(f"SAE path {number} holds a NUL character; give a directory path")
        if len(path) > MAX_PATH_CHARS:
            raise wb.InputError(f"SAE path {number} is {len(path)} characters long (at most {MAX_PATH_CHARS})")
    return paths


def candidates(shipped: dict[str, Path], chosen: Sequence[str], paths: Sequence[str]) -> list[Candidate]:
    """The SAEs to compare: the ``chosen`` shipped ones (labels of ``shipped``) then the opened ``paths``, each
    labelled by its name (a path by its folder's name), made unique with ``#2``, ``#3`` ...

    Example:
        >>> shipped = {"toy-sae (blocks.1.hook_resid_post)": Path("/zoo/toy-sae")}
        >>> [c.label for c in candidates(shipped, ["toy-sae (blocks.1.hook_resid_post)"], ["/x/toy-sae", "/y/b"])]
        ['toy-sae', 'toy-sae #2', 'b']
    """
    found: list[Candidate] = []
    seen: dict[str, int] = {}
    entries = [(choice.split(" (")[0], str(shipped[choice]), choice) for choice in chosen if choice in shipped]
    entries += [(Path(path).name or path, path, A_PATH) for path in paths]
    for name, path, source in entries:
        seen[name] = seen.get(name, 0) + 1
        found.append(Candidate(name if seen[name] == 1 else f"{name} #{seen[name]}", path, source))
    return found


def features_link(candidate: Candidate, model_source: str, impl: str, prompt: Optional[str] = None) -> str:
    """The relative link that opens ``candidate`` on the Features page (its picker's choice, the model and kernel,
    and the prompt when given); a path SAE's link fills in the path, which that page opens only on a click.

    Example:
        >>> features_link(Candidate("toy", "/zoo/toy", "toy (blocks.1.hook_resid_post)"), "toy-attn-2l", "sdpa")
        'Features?model=toy-attn-2l&impl=sdpa&features_sae_source=toy+%28blocks.1.hook_resid_post%29'
    """
    text = PICKERS["sae"]
    query = {"model": model_source, "impl": impl, text.key: candidate.source}
    if candidate.source == A_PATH:
        query[text.path_key] = candidate.path
    if prompt:
        query["prompt"] = prompt
    return f"{FEATURES_PAGE}?{urlencode(query)}"


def by_hook(compared: Sequence[Compared]) -> dict[str, list[Compared]]:
    """The opened SAEs grouped by the hook they read (and write, for a transcoder), in the order first seen.

    Example:
        >>> sae = wb.SAE(wb.SAEConfig("standard", d_in=128, d_sae=4, metadata={"hook_name": "blocks.0.hook_resid_post"}))
        >>> one = Compared(Candidate("a", "/a", A_PATH), "a", sae)
        >>> list(by_hook([one, Compared(Candidate("b", "/b", A_PATH), "b", sae)]))
        ['blocks.0.hook_resid_post']
    """
    groups: dict[str, list[Compared]] = {}
    for item in compared:
        groups.setdefault(item.hook, []).append(item)
    return groups


def bench_pool(model, data: str, n_tokens: int):
    """The data pool one comparison draws every seed's rows from: ``POOL_FACTOR`` times the 128-token windows one
    seed evaluates, as the ``bench`` command takes them (``experiments.cli.sae.data_windows``).

    Example:
        >>> bench_pool(model, "stdlib-held-out", 256).shape
        torch.Size([8, 128])
    """
    if data not in DATA_CHOICES:
        raise wb.InputError(f"data must be one of {list(DATA_CHOICES)}, got {data!r}")
    return data_windows(model, data, POOL_FACTOR * math.ceil(n_tokens / WINDOW))


def _bench(model, saes: tuple, data: str, n_tokens: int, n_seeds: int, progress) -> pd.DataFrame:
    named = {item.candidate.label: item.sae for item in saes}
    pool = bench_pool(model, data, n_tokens)
    rows_per_pass = min(pool.shape[0], max(1, math.ceil(n_tokens / pool.shape[1])))
    report = overall_progress(progress, passes=len(named) * n_seeds, rows_per_pass=rows_per_pass)
    return run_bench(model, named, pool, seeds=tuple(range(n_seeds)), n_tokens=n_tokens, progress=report)


_BENCH = LongRun("Measuring the SAEs (SAEBench core, every seed)", _bench)


def overall_progress(report: Callable[[int, int], None], passes: int,
                     rows_per_pass: int) -> Callable[[int, int], None]:
    """A ``(done, total)`` callback for one pass's rows that reports the progress over all ``passes`` (each SAE's
    seeds run one after another; a cached seed makes no call, and its rows are counted with the next pass's).

    Example:
        >>> seen = []
        >>> step = overall_progress(lambda done, total: seen.append((done, total)), passes=2, rows_per_pass=4)
        >>> for done in (2, 4, 2, 4): step(done, 4)
        >>> seen
        [(2, 8), (4, 8), (6, 8), (8, 8)]
    """
    state = {"finished": 0, "last": 0}

    def step(done: int, total: int) -> None:
        if done < state["last"] or state["last"] >= total:  # a new pass began (the last one had ended)
            state["finished"] += 1
        state["last"] = done
        report(min(state["finished"] * rows_per_pass + done, passes * rows_per_pass), passes * rows_per_pass)

    return step


def compare(loaded: LoadedModel, saes: Sequence[Compared], data: str, n_tokens: int, n_seeds: int,
            bar: ProgressBar) -> pd.DataFrame:
    """``run_bench``'s core measures of ``saes`` on ``data`` over seeds ``0 .. n_seeds - 1`` (``n_tokens`` tokens
    each): from this process's store, the disk cache, or computed with a progress bar.

    Example (on a page: it draws a bar):
        >>> table = compare(loaded, opened, "stdlib-held-out", 1024, 3, bar=progress_callback)   # doctest: +SKIP
    """
    return _BENCH(loaded, tuple(saes), data, int(n_tokens), int(n_seeds), bar=bar)


def is_measured(loaded: LoadedModel, saes: Sequence[Compared], data: str, n_tokens: int, n_seeds: int) -> bool:
    """Whether ``compare`` with these arguments returns at once from this process's store.

    Example:
        >>> is_measured(LoadedModel(model, "toy-attn-2l|sdpa"), (), "stdlib-held-out", 1024, 3)
        False
    """
    return _BENCH.is_stored(loaded, tuple(saes), data, int(n_tokens), int(n_seeds))


def measures_table(table: pd.DataFrame, n_seeds: int) -> pd.DataFrame:
    """``run_bench``'s long table as one row per measure (``HEADLINE`` first) and, per SAE, a ``value ± std``
    column; a second SAE onwards also gets a column saying whether it ``differs`` from the first beyond twice their
    pooled spread (``experiments.sae.bench.differs``; with one seed there is no spread to judge by).

    Example:
        >>> long = pd.DataFrame({"sae": ["a", "a", "b", "b"], "measure": ["l0", "mse", "l0", "mse"],
        ...                      "value": [16.0, 0.5, 32.0, 0.51], "std": [0.5, 0.02, 0.5, 0.02]})
        >>> measures_table(long, 3).to_dict("records")[0]
        {'measure': 'l0', 'a': '16 ± 0.5', 'b': '32 ± 0.5', 'b vs a': 'differs (+16)'}
    """
    names = list(dict.fromkeys(table["sae"]))
    measures = list(dict.fromkeys(table["measure"]))
    order = [m for m in HEADLINE if m in measures] + [m for m in measures if m not in HEADLINE]
    indexed = table.set_index(["sae", "measure"])
    rows = []
    for measure in order:
        row: dict[str, str] = {"measure": measure}
        for name in names:
            value, std = indexed.loc[(name, measure), ["value", "std"]]
            row[name] = f"{_number(value)} ± {_number(std)}"
        for name in names[1:]:
            row[f"{name} vs {names[0]}"] = _verdict(table, name, names[0], measure, n_seeds)
        rows.append(row)
    return pd.DataFrame(rows)


def _verdict(table: pd.DataFrame, name: str, first: str, measure: str, n_seeds: int) -> str:
    if n_seeds < 2:
        return "one seed: no spread"
    outcome = differs(table, name, first, measure)
    if math.isnan(outcome["difference"]):
        return "n/a"
    return f"{outcome['verdict']} ({outcome['difference']:+.4g})"


def _number(value: float) -> str:
    return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{float(value):.4g}"


def frontier_points(table: pd.DataFrame, y_measure: str) -> pd.DataFrame:
    """One row per SAE: its mean L0 and ``y_measure`` with their standard deviations over seeds (the frontier
    plot's points).

    Example:
        >>> long = pd.DataFrame({"sae": ["a", "a"], "measure": ["l0", "explained_variance"], "value": [16.0, 0.75],
        ...                      "std": [0.0, 0.01]})
        >>> frontier_points(long, "explained_variance").to_dict("records")
        [{'sae': 'a', 'l0': 16.0, 'l0_std': 0.0, 'y': 0.75, 'y_std': 0.01}]
    """
    rows = []
    indexed = table.set_index(["sae", "measure"])
    for name in dict.fromkeys(table["sae"]):
        l0, y = indexed.loc[(name, "l0")], indexed.loc[(name, y_measure)]
        rows.append({"sae": name, "l0": float(l0["value"]), "l0_std": float(l0["std"]), "y": float(y["value"]),
                     "y_std": float(y["std"])})
    return pd.DataFrame(rows)
