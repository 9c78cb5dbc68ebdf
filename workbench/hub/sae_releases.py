"""SAEs by SAELens release name: ``wb.load_sae(release, sae_id)``, ``wb.SAE.from_pretrained`` and ``wb.pretrained_saes``.

The registry is SAELens 6.54.12's ``pretrained_saes.yaml`` carried over as data (``sae_releases.json``, MIT
licence noted in it; ``tools/refresh_sae_releases.py`` regenerates it): per release its Hub repo, model and
conversion kind, per SAE its folder in the repo, Neuronpedia id and activation-norm scaling factor. The files an
SAE needs (``cfg.json`` and ``sae_weights.safetensors`` for the ``sae_lens`` kind; each other kind names its own in
``workbench.sae.foreign``) are fetched through ``huggingface_hub`` into the standard cache (``HF_ENDPOINT`` and
``HF_HUB_OFFLINE`` read at the call: ``workbench.hub.settings``) and read by ``workbench.sae.files``, as SAELens's
``SAE.from_pretrained`` does: the release's ``config_overrides`` and the Neuronpedia id laid over the config, and a
``norm_scaling_factor`` folded into the weights when the config says ``expected_average_only_in``.
"""

from __future__ import annotations

import difflib
import json
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Any, Optional

from huggingface_hub import hf_hub_download
from huggingface_hub.errors import LocalEntryNotFoundError

from workbench.errors import InputError
from workbench.hub import settings
from workbench.hub.errors import HubNotFoundError, hub_error
from workbench.hub.resolve import CONNECTION_ERRORS, LIBRARY

# Every conversion kind SAELens 6.54.12 names (its NAMED_PRETRAINED_SAE_LOADERS); those loaded here besides
# ``sae_lens`` are ``workbench.sae.foreign.KINDS``.
CONVERSION_KINDS = ("sae_lens", "connor_rob_hook_z", "gemma_2", "gemma_3", "llama_scope", "llama_scope_r1_distill",
                    "dictionary_learning_1", "deepseek_r1", "qwen_scope", "sparsify", "gemma_2_transcoder",
                    "mwhanna_transcoder", "mntss_clt_layer_transcoder", "temporal", "goodfire")

# The table, read from the JSON when first asked for (tests put a table of their own here).
_RELEASES: Optional[dict[str, dict[str, Any]]] = None


def releases() -> dict[str, dict[str, Any]]:
    """The registry: release name -> ``repo_id``, ``model``, ``conversion``, ``saes`` (each ``id``, ``path``, and
    ``neuronpedia`` / ``norm_scaling_factor`` where SAELens has them) and ``config_overrides`` where it has them.

    Example:
        >>> releases()["gpt2-small-res-jb"]["repo_id"]
        'jbloom/GPT2-Small-SAEs-Reformatted'
    """
    return _RELEASES if _RELEASES is not None else _packaged()


@lru_cache(maxsize=1)
def _packaged() -> dict[str, dict[str, Any]]:
    return json.loads(files("workbench.hub").joinpath("sae_releases.json").read_text(encoding="utf-8"))["releases"]


def pretrained_saes(model: Optional[str] = None):
    """SAELens's releases as a DataFrame (release, repo_id, model, conversion, n_saes), as SAELens's
    ``get_pretrained_saes_directory``; ``model`` keeps the releases for that model (SAELens's model name).

    Example:
        >>> table = wb.pretrained_saes(model="gpt2-small")
        >>> "gpt2-small-res-jb" in set(table.release), set(table.model)
        (True, {'gpt2-small'})
    """
    import pandas as pd

    rows = [{"release": name, "repo_id": row["repo_id"], "model": row["model"], "conversion": row["conversion"],
             "n_saes": len(row["saes"])} for name, row in releases().items()
            if model is None or row["model"] == model]
    if model is not None and not rows:
        raise InputError(f"no SAELens release is for model {model!r}{_close(model, {r['model'] for r in releases().values()})}")
    return pd.DataFrame(rows, columns=["release", "repo_id", "model", "conversion", "n_saes"])


def lookup(release: str, sae_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The release's row and the SAE's entry; an unknown name is an ``InputError`` with the closest names.

    Example:
        >>> lookup("gpt2-small-res-jb", "blocks.8.hook_resid_pre")[1]["neuronpedia"]
        'gpt2-small/8-res-jb'
        >>> lookup("gpt2-small-res-jbb", "blocks.8.hook_resid_pre")
        Traceback (most recent call last):
        workbench.errors.InputError: no SAELens release 'gpt2-small-res-jbb' (wb.pretrained_saes() lists them); did you mean 'gpt2-small-res-jb', ...
    """
    table = releases()
    if not isinstance(release, str) or release not in table:
        raise InputError(f"no SAELens release {release!r} (wb.pretrained_saes() lists them){_close(release, table)}")
    row = table[release]
    saes = {entry["id"]: entry for entry in row["saes"]}
    if sae_id not in saes:
        raise InputError(f"release {release!r} has no SAE {sae_id!r} ({len(saes)} SAEs){_close(sae_id, saes)}")
    return row, saes[sae_id]


def overrides_of(row: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """The config values SAELens lays over an SAE's own config: the release's ``config_overrides`` and the SAE's
    ``neuronpedia_id``.

    Example:
        >>> overrides_of(*lookup("gpt2-small-res-jb", "blocks.8.hook_resid_pre"))["neuronpedia_id"]
        'gpt2-small/8-res-jb'
    """
    overrides = dict(row.get("config_overrides") or {})
    if entry.get("neuronpedia") is not None:
        overrides["neuronpedia_id"] = entry["neuronpedia"]
    return overrides


def fetch_files(repo_id: str, names: list[str], revision: str = "main") -> list[Path]:
    """These files of the repo in the HF cache (downloaded if need be, after their sizes were checked against the
    free disk: ``HubDiskSpaceError``; offline, from the cache only).

    Example:
        >>> fetch_files("org/no-such-saes", ["layer_0/cfg.json"])   # the suite runs offline
        Traceback (most recent call last):
        workbench.hub.errors.HubNotFoundError: org/no-such-saes (revision 'main'): the Hub is switched off (HF_HUB_OFFLINE=1), and the cache ... holds no copy of ['layer_0/cfg.json']
    """
    from workbench.hub.disk import check_disk_space, files_to_download
    from workbench.hub.resume import resume_partials

    endpoint, cache = settings.endpoint(), settings.cache_dir()
    paths, missing, reason = [], [], "the Hub is switched off (HF_HUB_OFFLINE=1)"
    with settings.online_switch():
        # As a model's download: every file's size (one HEAD each) against the free disk before any byte is fetched.
        sizes = None if settings.offline() else files_to_download(repo_id, names, revision, endpoint, cache)
        if sizes:  # a killed process's partial files continued first (huggingface_hub would start again)
            resume_partials(repo_id, list(sizes), revision, endpoint, cache)
            check_disk_space(repo_id, sizes, cache)
        for name in names:
            try:
                paths.append(Path(hf_hub_download(repo_id, name, revision=revision, cache_dir=str(cache),
                                                  endpoint=endpoint, library_name=LIBRARY)))
            except LocalEntryNotFoundError as error:
                if not settings.offline():
                    reason = f"the Hub at {endpoint} could not be reached ({type(error.__cause__ or error).__name__})"
                missing.append(name)
            except CONNECTION_ERRORS as error:
                reason = f"the Hub at {endpoint} could not be reached ({type(error).__name__})"
                missing.append(name)
            except Exception as error:
                raise (hub_error(error, repo_id, revision, endpoint, name) or error) from error
    if missing:
        raise HubNotFoundError(f"{repo_id} (revision {revision!r}): {reason}, and the cache {cache} holds no copy of "
                               f"{missing}", whole_repo=len(missing) == len(names))
    return paths


def fetch_optional(repo_id: str, names: list[str], revision: str = "main") -> dict[str, Path]:
    """Those of these files the repo has, in the HF cache (downloaded if need be), by name: only the Hub's "no such
    file" (or the cache's record of that answer) counts as absent; offline with nothing cached, an unknown repo or a
    refused token stay errors naming the repo.

    Example:
        >>> fetch_optional("org/no-such-saes", ["layer_0/config.json"])   # the suite runs offline
        Traceback (most recent call last):
        workbench.hub.errors.HubNotFoundError: org/no-such-saes (revision 'main'): the Hub is switched off ...
    """
    from huggingface_hub import _CACHED_NO_EXIST, try_to_load_from_cache

    found = {}
    for name in names:
        try:
            found[name] = fetch_files(repo_id, [name], revision)[0]
        except HubNotFoundError as error:
            if not error.whole_repo:  # the repo answered: no such file
                continue
            cached = try_to_load_from_cache(repo_id, name, cache_dir=str(settings.cache_dir()), revision=revision)
            if cached is not _CACHED_NO_EXIST:  # offline, and no earlier answer of "no such file" is cached
                raise
    return found


def _close(name: Any, known) -> str:
    matches = difflib.get_close_matches(str(name), list(known), n=3, cutoff=0.6)
    matches += sorted(k for k in known if str(name) in k and k not in matches)[:3]
    return f"; did you mean {', '.join(map(repr, matches))}?" if matches else ""
