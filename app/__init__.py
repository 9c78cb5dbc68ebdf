"""The Streamlit dashboard: ``streamlit run app/Home.py`` (or ``make run``).

Pages live in ``app/pages/``; the shared helpers are ``state`` (which model is open, loaded once
per process), ``results`` (cached calls into ``experiments``), ``widgets`` (prompt box, head and
layer pickers, error guard) and ``downloads`` (CSV / HTML / PNG buttons). The app only draws:
every number on a page comes from an ``experiments`` function.
"""
