"""Models from the Hugging Face Hub on the dashboard: a repo id typed on Home, a link's repo id, the HF cache's models.

Nothing is downloaded but on a click ("Download and open"), and the download's bytes are shown as they
arrive: ``workbench.hub.download_model`` runs in a worker thread and reports them, and this script's
thread (the only one that may draw) moves a progress bar until it ends. Then the repo id becomes the
session's model, loaded from the cache like any other (``app.widgets.open_model``). A link naming a repo
id only offers it (``state.linked_model_offer``), as a link naming a path does. The models the HF cache
holds are listed (``huggingface_hub.scan_cache_dir``) and open with no network. Errors from the Hub
(offline, no such repo, gated, no disk) are shown as ``workbench.hub``'s messages.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Optional

import pandas as pd
import streamlit as st

import workbench as wb
from app import state
from app.safe_text import quoted
from workbench import hub
from workbench.hub import settings
from workbench.memory import readable_bytes

log = logging.getLogger(__name__)
POLL_S = 0.2  # how often the progress bar is redrawn while the download runs


def is_hub_source(source: str) -> bool:
    """``source`` is read from the Hub by ``wb.load_model``: no registered name, no path here, a repo id's shape.

    Example:
        >>> is_hub_source("EleutherAI/pythia-70m"), is_hub_source("toy-attn-2l"), is_hub_source("/no/such/dir")
        (True, False, False)
    """
    return (isinstance(source, str) and source not in wb.list_models()["name"].tolist()
            and not Path(source).exists() and hub.is_hub_name(source))


def picker(impl: str) -> None:
    """Home's Hub part: a repo id to download (after the click, with its progress) and open, and the cached models.

    Example:
        >>> picker("sdpa")   # doctest: +SKIP
    """
    with st.form("hub_picker"):
        source = st.text_input("Hugging Face Hub repo id (org/name) or TransformerLens name", key="hub_repo_id",
                               placeholder="EleutherAI/pythia-70m")
        clicked = st.form_submit_button("Download and open")
    if clicked:
        source = source.strip()
        if not is_hub_source(source):
            st.error(f"{quoted(source or ' ')} is not a Hub repo id (org/name): a registered name or a path goes "
                     "in the picker above.")
        elif download(source):
            state.choose_model(source, impl)
    _cached(impl)


def download(source: str) -> bool:
    """Downloads what ``wb.load_model(source)`` reads into the HF cache, a progress bar following the bytes; True
    when it is all there, else False after showing why.

    Example:
        >>> download("EleutherAI/pythia-70m")   # doctest: +SKIP
        True
    """
    slot = st.empty()
    bar = slot.progress(0.0, text=f"Downloading {quoted(source)} …")
    progress, outcome = [0, 0], {}

    def work() -> None:
        try:
            outcome["fetched"] = hub.download_model(source, on_progress=lambda done, total: progress.__setitem__(
                slice(0, 2), (done, total)))
        except Exception as error:  # noqa: BLE001 - shown below, in this script's thread
            outcome["error"] = error

    worker = threading.Thread(target=work, name=f"hub-download {source}", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(POLL_S)
        done, total = progress
        if total:
            bar.progress(min(1.0, done / total), text=f"Downloading {quoted(source)}: {readable_bytes(done)} of "
                                                      f"{readable_bytes(total)}")
    slot.empty()
    error = outcome.get("error")
    if isinstance(error, (wb.CheckpointError, wb.InputError, wb.ConfigError)):
        st.error(f"Could not download {quoted(source)}: {quoted(error, limit=600)}")
        return False
    if error is not None:
        log.error("Hub download of %r failed", source, exc_info=error)
        st.error(f"Could not download {quoted(source)} ({type(error).__name__}): {quoted(error, limit=300)}. "
                 "The server log has the details.")
        return False
    origin = outcome["fetched"].origin
    st.success(f"Downloaded {quoted(origin.repo_id)} at commit {quoted(origin.commit[:12])}"
               + (f" ({readable_bytes(progress[1])})" if progress[1] else " (all of it was in the cache)"))
    return True


def cached_models(cache: Optional[Path] = None) -> pd.DataFrame:
    """The model repos the HF cache holds: ``repo_id``, ``size`` (on disk), ``revisions`` (each ref -> its commit,
    or the commit alone), ``files`` and ``last_modified``; ``cache`` is the HF cache (default: as the Hub's is found).

    Example:
        >>> cached_models(Path("/no/such/cache")).columns.tolist()
        ['repo_id', 'size', 'revisions', 'files', 'last_modified']
    """
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    columns = ["repo_id", "size", "revisions", "files", "last_modified"]
    try:
        scanned = scan_cache_dir(settings.cache_dir(cache))
    except (CacheNotFound, OSError):
        return pd.DataFrame(columns=columns)
    rows = [{"repo_id": repo.repo_id, "size": readable_bytes(repo.size_on_disk),
             "revisions": ", ".join(_revision(revision) for revision in sorted(repo.revisions, key=_revision)),
             "files": repo.nb_files, "last_modified": pd.Timestamp(repo.last_modified, unit="s").floor("s")}
            for repo in sorted(scanned.repos, key=lambda repo: repo.repo_id) if repo.repo_type == "model"]
    return pd.DataFrame(rows, columns=columns)


def _revision(revision) -> str:
    commit = revision.commit_hash[:12]
    return ", ".join(f"{ref} → {commit}" for ref in sorted(revision.refs)) if revision.refs else commit


def _cached(impl: str) -> None:
    """The cached models, one of which opens from the cache (no download; the Hub asked only if it answers)."""
    models = cached_models()
    with st.expander(f"Models in the Hugging Face cache ({len(models)})", expanded=False):
        if models.empty:
            st.caption(f"The cache {quoted(settings.cache_dir())} holds no model yet.")
            return
        st.dataframe(models, hide_index=True)
        choice = st.selectbox("Cached model", models["repo_id"].tolist(), key="hub_cached_choice")
        if st.button("Open from the cache", key="hub_open_cached"):
            try:
                hub.download_model(choice, local_files_only=True)  # every file it reads is there: no network
            except wb.CheckpointError as error:
                st.error(f"Could not open {quoted(choice)} from the cache: {quoted(error, limit=600)}")
            else:
                state.choose_model(choice, impl)


def linked_offer(source: str, impl: Optional[str]) -> None:
    """A link's Hub repo id, offered with a button: nothing is downloaded until the user clicks.

    Example:
        >>> linked_offer("EleutherAI/pythia-70m", None)   # doctest: +SKIP
    """
    slot = st.empty()
    with slot.container():
        st.info(f"This link names a Hugging Face Hub model: {quoted(source, limit=200)}. Nothing is downloaded "
                "until you ask; meanwhile the pages use the model shown below.")
        clicked = st.button("Download and open the linked model", key="open_linked_hub_model")
    if clicked and download(source):
        state.choose_model(source, impl)
        slot.empty()
