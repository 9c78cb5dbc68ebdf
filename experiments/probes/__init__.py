"""Linear probes: logistic and mass-mean, fitted on activations, scored by held-out accuracy and AUROC.

``fit.py`` holds the fits (one implementation that every probe in the workbench uses: per-layer probes,
sparse probes on SAE latents, SAEBench's sparse probing, absorption and SCR/TPP), ``scores.py`` the scores
and the stratified split.
"""

from experiments.probes.fit import LinearProbe, fit_logistic, fit_mass_mean
from experiments.probes.scores import accuracy, auroc, stratified_split

__all__ = ["LinearProbe", "fit_logistic", "fit_mass_mean", "accuracy", "auroc", "stratified_split"]
