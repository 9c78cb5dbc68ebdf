"""The Streamlit dashboard: ``python -m app.serve`` (``streamlit run app/Home.py`` with the default model loading
from launch; ``make run``).

Pages live in ``app/pages/`` and only lay out. The shared helpers, each importing only those
listed after it: ``widgets`` (page setup, error and model guards, prompt box, head and layer
pickers, progress bar), ``hub_picker`` (a Hub repo id downloaded after a click, with its progress; the HF
cache's models), ``artifact_picker`` (the one SAE / transcoder picker), ``ablation_picker`` (the
ablation page's head picker), ``attention_views`` (the Attention page's default grid range and who-attends
view), ``special_tokens`` (BOS, pad left out of colour scales and defaults; the toggle), ``token_widgets`` (token pickers), ``feature_card`` (one SAE feature's card), ``sae_compare_figure`` (the SAE compare page's L0 frontier),
``url_state`` (what a link may set, checked), ``safe_text`` (user and link values shown as literal text), ``downloads`` (CSV / HTML / PNG buttons), ``results`` (the one cache
layer: the loaded models and every cached call into ``experiments``), ``state`` (which model
the session has chosen) and ``runtime`` (process settings, applied when a page starts, never on
import); ``serve`` is the server's launcher. The app only draws: every number and figure on a page comes from ``experiments``.
"""
