"""One SAE-training measurement for ``bench_sae``, in a fresh process; runs under either venv: ours
(``experiments.sae.synthetic.train_sae_on_synthetic_data``) or the reference one with SAELens 6.54
(``sae_lens.synthetic.train_toy_sae``), on the same synthetic configuration and batch.

    python sae_train_child.py ours|saelens SAMPLES   # prints a JSON line: seconds, samples_per_s

Both generate their samples as they train (each library's own ``FeatureDictionary`` and ``ActivationGenerator``
with the same knobs) and train a top-k SAE (``k`` = 8) with Adam at batch ``BATCH``.
"""

from __future__ import annotations

import json
import sys
import time

N_FEATURES, HIDDEN, D_SAE, K, BATCH = 1024, 256, 1024, 8, 1024


def main(contender: str, samples: int) -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if contender == "ours":
        from experiments.sae.synthetic import ActivationGenerator, FeatureDictionary, zipfian_firing_probabilities
        from experiments.sae.synthetic.training import train_sae_on_synthetic_data
    else:
        from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig
        from sae_lens.synthetic import ActivationGenerator, FeatureDictionary, zipfian_firing_probabilities
        from sae_lens.synthetic.training import train_toy_sae
    fd = FeatureDictionary(N_FEATURES, HIDDEN, seed=0)
    gen = ActivationGenerator(N_FEATURES, zipfian_firing_probabilities(N_FEATURES, exponent=0.5, max_prob=0.05,
                                                                       min_prob=0.002))
    start = time.perf_counter()
    if contender == "ours":
        train_sae_on_synthetic_data(fd, gen, "topk", d_sae=D_SAE, k=K, training_samples=samples, batch_size=BATCH,
                                    lr=3e-4)
    else:
        sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=HIDDEN, d_sae=D_SAE, k=K))
        train_toy_sae(sae, fd, gen, training_samples=samples, batch_size=BATCH, lr=3e-4)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "samples_per_s": samples / seconds}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
