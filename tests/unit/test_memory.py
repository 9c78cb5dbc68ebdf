"""``wb.keep_freed_memory``: glibc keeps freed blocks for reuse instead of returning them to the kernel.

Checked in fresh processes (the setting is process-wide): a freed 256 MiB tensor leaves the resident
memory as it was only once the setting is applied.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys, torch, workbench as wb

def rss_anon_mib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024

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
