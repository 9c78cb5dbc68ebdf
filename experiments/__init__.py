"""Scripted interpretability experiments: pure functions over a ``workbench.Decoder``.

Each module takes a model and token ids and returns tensors, pandas DataFrames and plotly
figures; none imports Streamlit. Each also runs as ``python -m experiments.<name> --model NAME
--out DIR``, writing a CSV, a JSON summary and a standalone HTML figure.

Modules: ``attention`` (patterns, per-head statistics), ``induction`` (repeated-random-token
induction scores and loss), ``detectors`` (TransformerLens-style head detectors), ``ablation``
(zero / mean / resample ablation, batched head sweeps), ``patching`` (activation and
attribution patching), ``lens`` (logit lens, direct logit attribution), ``heads`` (every
per-head score in one table, composition scores), ``router`` (mixture-of-experts routing).

Example:
    >>> from experiments.induction import induction_scores
    >>> scores_LH = induction_scores(model)          # doctest: +SKIP
"""
