"""What goes wrong before and around a download, said with the repo, the revision and what to do.

huggingface_hub's own errors name neither the repo nor the token (a gated repo is "401 Client Error"
with a URL); ``hub_error`` turns each into one of ours, which are ``CheckpointError``s, so code that
catches a bad checkpoint catches these too, and also builtins (``FileNotFoundError``,
``PermissionError``, ``OSError``) for callers that catch those.
"""

from __future__ import annotations

from typing import Optional

from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RemoteEntryNotFoundError,
                                    RepositoryNotFoundError, RevisionNotFoundError)

from workbench.errors import CheckpointError


class HubError(CheckpointError):
    """A model could not be fetched from the Hub; the message names the repo and the revision.

    Example:
        >>> issubclass(HubError, wb.CheckpointError)
        True
    """


class HubNotFoundError(HubError, FileNotFoundError):
    """The repo, the revision or a file is not on the Hub, or (offline) not in the cache.

    ``whole_repo`` is True when nothing of the repo could be found (then ``load_model`` adds that the
    source is no local path or registered name either).

    Example:
        >>> error = HubNotFoundError("org/name: no such model repo", whole_repo=True)
        >>> isinstance(error, FileNotFoundError), error.whole_repo
        (True, True)
    """

    def __init__(self, message: str, whole_repo: bool = False):
        super().__init__(message)
        self.whole_repo = whole_repo


class HubAccessError(HubError, PermissionError):
    """The repo is gated or private and the request carried no token that may read it.

    Example:
        >>> issubclass(HubAccessError, PermissionError)
        True
    """


class HubDiskSpaceError(HubError, OSError):
    """The files to download do not fit on the disk of the cache; refused before any byte is fetched.

    Example:
        >>> issubclass(HubDiskSpaceError, OSError)
        True
    """


def access_advice(repo_id: str, endpoint: str) -> str:
    """What to do about a gated or private repo.

    Example:
        >>> access_advice("org/name", "https://huggingface.co")
        'accept its licence at https://huggingface.co/org/name (logged in), then set HF_TOKEN to a token that may read it (or pass token=..., or run `hf auth login`)'
    """
    return (f"accept its licence at {endpoint}/{repo_id} (logged in), then set HF_TOKEN to a token that may read it "
            "(or pass token=..., or run `hf auth login`)")


def hub_error(error: Exception, repo_id: str, revision: str, endpoint: str,
              filename: Optional[str] = None) -> Optional[HubError]:
    """Our error for a huggingface_hub HTTP error (None for anything else, which the caller re-raises).

    Example:
        >>> hub_error(ValueError("not an HTTP error"), "org/name", "main", "https://huggingface.co") is None
        True
    """
    where = f"{repo_id} (revision {revision!r}) on {endpoint}"
    if isinstance(error, GatedRepoError):
        return HubAccessError(f"{where} is gated: {access_advice(repo_id, endpoint)}")
    if isinstance(error, RepositoryNotFoundError):
        status = _status(error)
        return HubNotFoundError(f"{where}: no model repo of that name (HTTP {status}); if it is private, set HF_TOKEN "
                                "(or pass token=...) to a token that may read it", whole_repo=True)
    if isinstance(error, RevisionNotFoundError):
        return HubNotFoundError(f"{repo_id}: no revision {revision!r} on {endpoint} (a branch, tag or commit sha)")
    if isinstance(error, RemoteEntryNotFoundError):
        return HubNotFoundError(f"{where}: no file {filename or _url_file(error)!r} in the repo")
    if isinstance(error, HfHubHTTPError):
        status = _status(error)
        if status in (401, 403):
            return HubAccessError(f"{where}: access refused (HTTP {status}): {access_advice(repo_id, endpoint)}")
        return HubError(f"{where}: the Hub answered HTTP {status} ({str(error).splitlines()[0]})")
    return None


def _status(error: HfHubHTTPError) -> Optional[int]:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


def _url_file(error: HfHubHTTPError) -> str:
    response = getattr(error, "response", None)
    url = str(getattr(getattr(response, "request", None), "url", "") or "")
    return url.split("/resolve/", 1)[-1].split("/", 1)[-1] if "/resolve/" in url else "?"
