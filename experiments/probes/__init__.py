"""Linear probes: logistic and mass-mean, fitted on activations, scored by held-out accuracy and AUROC.

``fit.py`` holds the fits (one implementation that every probe in the workbench uses: per-layer probes,
sparse probes on SAE latents, SAEBench's sparse probing, absorption and SCR/TPP), ``scores.py`` the scores
and the stratified split, ``train.py`` probes per hook over labelled texts (``train_probe``), ``monitor.py`` a
probe's score per token during a forward pass or ``generate`` (``probe_monitor``), ``sparse.py`` probes on
an SAE's top-k latents (``sparse_probe``, SAEBench's ``top_k_mean_diff`` rule). Figures:
``experiments.plots.probes``.
"""

from experiments.probes.fit import LinearProbe, fit_logistic, fit_mass_mean
from experiments.probes.monitor import MonitorLog, probe_monitor
from experiments.probes.scores import accuracy, auroc, stratified_split
from experiments.probes.train import ProbeRun, probe_activations, train_probe
from experiments.probes.sparse import sparse_probe, top_k_mean_diff

__all__ = ["LinearProbe", "fit_logistic", "fit_mass_mean", "accuracy", "auroc", "stratified_split", "ProbeRun",
           "probe_activations", "train_probe", "MonitorLog", "probe_monitor", "sparse_probe", "top_k_mean_diff"]
