"""``wb.keep_freed_memory``: glibc keeps freed blocks for reuse instead of returning them to the kernel.

Checked in fresh processes (the setting is process-wide): a freed 256 MiB tensor leaves the resident
memory as it was only once the setting is applied.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a fresh process per check (the setting is process-wide)

RSS_ANON = """
import sys, torch, workbench as wb

def rss_anon_mib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
"""

SCRIPT = RSS_ANON + """
applied = wb.keep_freed_memory() if sys.argv[1] == "keep" else None
block = torch.ones(64 * 2**20)   # 256 MiB, touched
held = rss_anon_mib()
del block
print(applied, held - rss_anon_mib())
"""


def _freed_mib(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True).stdout
    applied, freed = out.split()
    return applied, float(freed)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_stays_in_the_process_only_when_asked():
    applied, freed_default = _freed_mib("default")
    assert freed_default > 200  # by default the 256 MiB block goes back to the kernel at once
    applied, freed_kept = _freed_mib("keep")
    assert applied == "True"
    assert freed_kept < 16  # kept for reuse: the next cache of that size takes no page faults


# The cacher applies the setting itself, the first time a process caches: a user who caches gets it by
# default, and a process that only runs forwards or hooks keeps glibc's defaults (it gives freed memory back).
AUTOMATIC = RSS_ANON + """
model = wb.load_model("toy-attn-2l", progress=False)
tokens = torch.randint(0, model.cfg.d_vocab, (2, 16))
calls = {"forward": lambda: model(tokens),
         "hooks": lambda: model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x)]),
         "cache": lambda: model.run_with_cache(tokens)}
for call in sys.argv[1].split(","):
    calls[call]()
block = torch.ones(64 * 2**20)   # 256 MiB, touched
held = rss_anon_mib()
del block
print(held - rss_anon_mib())
"""


def _freed_after(call: str, opt_out: bool = False) -> float:
    env = {name: value for name, value in os.environ.items() if name != "WORKBENCH_KEEP_FREED_MEMORY"}
    if opt_out:
        env["WORKBENCH_KEEP_FREED_MEMORY"] = "0"
    out = subprocess.run([sys.executable, "-c", AUTOMATIC, call], capture_output=True, text=True, check=True,
                         env=env).stdout
    return float(out.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_caching_keeps_freed_memory_by_default_and_nothing_else_does():
    assert _freed_after("forward,hooks") > 200  # a process that never caches: glibc's defaults, untouched
    assert _freed_after("cache") < 16  # the first run_with_cache applied keep_freed_memory
    assert _freed_after("cache", opt_out=True) > 200  # the documented opt-out
