"""The Streamlit dashboard: ``streamlit run app/Home.py`` (or ``make run``).

Pages live in ``app/pages/`` and only lay out. The shared helpers, each importing only those
listed after it: ``widgets`` (page setup, error and model guards, prompt box, head and layer
pickers, progress bar), ``downloads`` (CSV / HTML / PNG buttons), ``results`` (the one cache
layer: the loaded models and every cached call into ``experiments``), ``state`` (which model
the session has chosen) and ``runtime`` (process settings, applied when a page starts, never on
import). The app only draws: every number and figure on a page comes from ``experiments``.
"""
