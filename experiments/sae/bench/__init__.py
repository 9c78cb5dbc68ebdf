"""SAEBench 0.6's measures of SAEs, with their spread over seeds, cached on disk.

- ``core``: one seed's pass with SAEBench's core definitions (``core_pass``: KL and CE scores against the
  zero-ablation, explained variance, MSE, cosine similarity, norms and shrinkage, L0 / L1, feature density);
- ``run``: ``core_metrics`` (one SAE over seeds), ``run_bench`` (several SAEs), ``differs`` (two SAEs beyond their
  spread?), and the disk cache.

- ``sparse_probing``: top-k-latent probes against probes on the raw activation on labelled offline text
  (``sparse_probing_metrics``; texts from ``experiments.datasets.labelled``);
- ``absorption``: feature absorption on the first-letter task (``absorption_metrics``);
- ``store``: the per-seed disk cache and the table of a measure over seeds with its spread.

SAEBench's SCR and TPP are not built (``run_bench`` refuses them by name, saying why).
``python -m experiments.sae bench`` is the command line.
"""

from experiments.sae.bench.absorption import absorption_metrics
from experiments.sae.bench.core import MEASURES, core_pass
from experiments.sae.bench.run import core_metrics, differs, run_bench
from experiments.sae.bench.sparse_probing import sparse_probing_metrics

__all__ = ["core_metrics", "run_bench", "differs", "core_pass", "MEASURES", "sparse_probing_metrics",
           "absorption_metrics"]
