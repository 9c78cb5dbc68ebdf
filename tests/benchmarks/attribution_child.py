"""One measurement for ``bench_attribution``, in a process of its own (so its peak memory is its own); runs under
either venv: the project's (``ours``) or the reference one with circuit-tracer 0.5 (``reference``).

    python attribution_child.py make DIR                     # the random Llama, tokenizer and transcoders
    python attribution_child.py ours|reference DIR N_TOKENS  # one attribution; prints a JSON line

The model is a random Llama saved by transformers with a word-level tokenizer (as the parity fixtures'), the
transcoders a circuit-tracer per-layer set (``config.yaml`` + ``layer_{i}.safetensors``, ReLU) whose encoder bias
leaves a few dozen features active per token and layer.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

D_MODEL, D_MLP, N_LAYERS, N_HEADS, N_KV, VOCAB, D_TRANSCODER = 64, 256, 4, 4, 2, 500, 256
BATCH_SIZE, MAX_FEATURE_NODES, MAX_N_LOGITS, LOGIT_PROB = 32, 1024, 10, 0.95


def make(folder: Path) -> None:
    import torch
    import yaml
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    words = ["<unk>", "<bos>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(folder)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=D_MLP, num_hidden_layers=N_LAYERS,
                      num_attention_heads=N_HEADS, num_key_value_heads=N_KV, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if name.endswith("norm.weight") else 0.1 * torch.randn_like(param))
    model.save_pretrained(folder / "model", safe_serialization=True)
    PreTrainedTokenizerFast.from_pretrained(folder).save_pretrained(folder / "model")
    for layer in range(N_LAYERS):
        save_file({"W_enc": torch.randn(D_TRANSCODER, D_MODEL) / D_MODEL ** 0.5,
                   "W_dec": 0.1 * torch.randn(D_TRANSCODER, D_MODEL),
                   "b_enc": torch.full((D_TRANSCODER,), -1.9), "b_dec": torch.zeros(D_MODEL)},
                  str(folder / f"layer_{layer}.safetensors"))
    config = {"model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in", "feature_output_hook": "mlp.hook_out",
              "scan": "bench", "transcoders": [f"layer_{i}.safetensors" for i in range(N_LAYERS)]}
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def prompt_ids(n_tokens: int) -> list[int]:
    import torch

    generator = torch.Generator().manual_seed(n_tokens)
    return [1] + torch.randint(3, VOCAB, (n_tokens - 1,), generator=generator).tolist()


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(who: str, folder: Path, n_tokens: int) -> dict:
    import torch

    torch.set_grad_enabled(True)
    ids = prompt_ids(n_tokens)
    options = dict(max_n_logits=MAX_N_LOGITS, desired_logit_prob=LOGIT_PROB, batch_size=BATCH_SIZE,
                   max_feature_nodes=MAX_FEATURE_NODES)
    if who == "ours":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        import workbench as wb
        from experiments.attribution import attribute

        model, transcoders = wb.load_model(folder / "model"), wb.load_transcoders(folder / "config.yaml")

        def run(prompt=ids):
            return attribute(model, transcoders, prompt, progress=False, **options)
    else:
        import yaml
        from circuit_tracer import attribute
        from circuit_tracer.replacement_model import ReplacementModel
        from circuit_tracer.utils.hf_utils import load_transcoders

        config = yaml.safe_load((folder / "config.yaml").read_text())
        config["transcoders"] = [str(folder / path) for path in config["transcoders"]]
        transcoders = load_transcoders(config, device=torch.device("cpu"), dtype=torch.float32)
        model = ReplacementModel.from_pretrained_and_transcoders(str(folder / "model"), transcoders, backend="nnsight",
                                                                 device=torch.device("cpu"), dtype=torch.float32)

        def run(prompt=ids):
            return attribute(torch.tensor(prompt), model, **options)
    run(ids[:8])   # warm-up: the first gradient call in a process imports sympy through torch (3 s here)
    base = rss()
    start = time.perf_counter()
    graph = run()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak_rss": peak, "attribution_rss": peak - base,
            "n_active": int(graph.active_features.shape[0]), "n_nodes": int(graph.adjacency_matrix.shape[0])}


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]))
    else:
        print(json.dumps(measure(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))))
