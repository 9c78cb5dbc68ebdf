"""Models from the Hugging Face Hub by repo id, through ``huggingface_hub`` and its standard cache.

``load_model("org/name")``, ``model_config`` and ``plan_memory`` come here for any source that is not a
registered name or an existing path but has the shape of a repo id or is a TransformerLens model name
(``names``). ``fetch_model`` (``download``) fetches what a load reads (``files``) of the repo at its revision (``resolve``),
resuming what a killed process left (``resume``), after the disk check (``disk``), and
yields a local checkpoint (``download_model``: the same files, not loaded, with a progress callback); ``fetch_config`` yields config.json and the weights' headers only
(``headers``). The Hub switches are read at each call (``settings``); huggingface_hub's errors become
ours, naming the repo and what to do (``errors``). Pickled weights are read with
``torch.load(weights_only=True)`` only (``pickled``); remote code is never fetched or run. SAEs by SAELens
release name (``wb.load_sae(release, sae_id)``, ``wb.pretrained_saes()``) are ``sae_releases``, its registry
SAELens's ``pretrained_saes.yaml`` as data (``sae_releases.json``). An SAE in a folder of any repo
(``wb.load_sae("org/repo", folder="path")``: SAELens's layout or EleutherAI sparsify's) is ``sae_folders``.
Transcoder sets from the Hub (circuit-tracer's presets ``gemma`` / ``llama``, repo ids, ``hf://`` entries of a
``config.yaml``) are resolved by ``transcoder_sources`` for ``wb.load_transcoders``.
"""

from workbench.hub.download import Fetched, HubOrigin, download_model, fetch_model
from workbench.hub.errors import HubAccessError, HubDiskSpaceError, HubError, HubNotFoundError
from workbench.hub.headers import fetch_config
from workbench.hub.names import is_hub_name, repo_id_for, transformer_lens_names

__all__ = ["fetch_model", "download_model", "fetch_config", "Fetched", "HubOrigin", "is_hub_name", "repo_id_for",
           "transformer_lens_names", "HubError", "HubNotFoundError", "HubAccessError", "HubDiskSpaceError"]
