"""Command lines of the experiments: ``python -m experiments.<name>`` runs ``experiments.cli.<name>.main``.

One module per command, named after the experiment it runs: ``ablation``, ``attention``, ``circuits``,
``detectors``, ``flow``, ``heads``, ``induction``, ``ioi``, ``lens``, ``lenses``, ``patching``, ``router``, ``sae`` and ``zoo``.
"""
