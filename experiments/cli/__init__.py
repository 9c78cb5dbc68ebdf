"""Command lines of the experiments: ``python -m experiments.<name>`` runs ``experiments.cli.<name>.main``."""
