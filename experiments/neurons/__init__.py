"""MLP neurons: one neuron's activation on a prompt, its top-activating windows over the bundled corpus
(computed once per MLP for all its neurons, cached on disk) and its direct effect on the logits.

Legend: B batch, P position, D d_model, M d_mlp, V d_vocab, N flattened tokens.

Modules: ``units`` (where a neuron lives and its activation and logit effect), ``windows`` (its top windows
over the corpus).

Where a neuron lives (an ``MLPUnit``) and where its activation is read:
  dense MLP      blocks.{l}.mlp.hook_post [B, P, M] (the input to W_out)
  routed expert  no hook has it: computed here from the MLP's input and expert e's weights (W_gate / W_in
                 [E, D, M], b_gate / b_in, the activation; gpt-oss's clamped SwiGLU with ``swiglu_limit``).
                 Only the tokens the router sent to e (``hook_expert_indices``) count: elsewhere the
                 activation is NaN (the expert never ran there).
  shared expert  blocks.{l}.mlp.shared.hook_post [B, P, M]
The MLP's input is ``blocks.{l}.ln2.hook_normalized`` where a norm precedes the MLP, and
``hook_resid_mid`` in post-norm and sublayer-output blocks (their MLP reads the raw residual).

Direct logit effect: ``W_out[neuron] @ W_U``, by default through the final norm's gain (its linear part
at unit scale: RMSNorm multiplies by w, LayerNorm centres then multiplies by w). The norm's per-token
divisor is left out (a positive factor: rankings are exact), and so are an expert's router weight and
a shared expert's gate: the effect is per unit of the neuron's activation.

Top windows (``corpus_maxima``): one scan of the corpus-window engine (``experiments.corpus_windows``, shared
with the SAE features' top windows) over ``window``-token windows of a corpus (``corpus``: ``"english"`` prose or ``"code"``, the Python standard
library; by default the one the model was trained on, ``experiments.corpus_windows.default_corpus``); for every neuron of the MLP (``mlp_source``), the max over
each window's positions (BOS excluded: it is an outlier for most neurons) and where it is (``WindowMaxima``).
Kept in the engine's one disk cache under ``cache_directory()/neurons``, keyed by the weights' digest, the MLP,
the window token ids and the engine's version, written atomically.

The HTML of the top windows is ``experiments.plots.neurons``.
"""

from experiments.neurons.units import (MLPUnit, direct_logit_effect, mlp_units, neuron_activation, output_weights,
                                       unit_activations)
from experiments.neurons.windows import (CACHE_ENV, CorpusMaxima, WindowMaxima, cache_directory, corpus_maxima,
                                         maxima_path, mlp_source, neuron_corpus, top_windows, weights_digest)

__all__ = ["MLPUnit", "mlp_units", "unit_activations", "neuron_activation", "output_weights", "direct_logit_effect",
           "CACHE_ENV", "CorpusMaxima", "cache_directory", "weights_digest", "neuron_corpus", "maxima_path",
           "corpus_maxima", "top_windows", "WindowMaxima", "mlp_source"]
