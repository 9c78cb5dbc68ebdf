"""SAEBench 0.6's measures of SAEs, with their spread over seeds, cached on disk.

- ``core``: one seed's pass with SAEBench's core definitions (``core_pass``: KL and CE scores against the
  zero-ablation, explained variance, MSE, cosine similarity, norms and shrinkage, L0 / L1, feature density);
- ``run``: ``core_metrics`` (one SAE over seeds), ``run_bench`` (several SAEs), ``differs`` (two SAEs beyond their
  spread?), and the disk cache.

SAEBench's absorption, sparse probing, SCR and TPP are later work (``run_bench`` refuses them by name).
``python -m experiments.sae bench`` is the command line.
"""

from experiments.sae.bench.core import MEASURES, core_pass
from experiments.sae.bench.run import core_metrics, differs, run_bench

__all__ = ["core_metrics", "run_bench", "differs", "core_pass", "MEASURES"]
