"""The ``--json`` file every benchmark tool writes: its figures, and where they came from.

Each file names the tool, the command line that produced it and the machine (cores, CPU
model, accelerator, the load average while writing), so a figure in the docs can be traced to
a run (``tests/test_docs.py`` checks the committed files say so) without anyone adding that by
hand.  ``tools/plot_benchmarks.py`` reads the sections the tools add beside these keys.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from typing import Any

__all__ = ["machine", "write_figures"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """One line: cores, CPU model, whether a CUDA device is visible, and the load average."""
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        gpu = "no torch"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{os.cpu_count()} cores ({_cpu_model()}), {gpu}, load {load} when written"


def write_figures(path: str, tool: str, sections: dict[str, Any]) -> None:
    """Write ``sections`` (rows, runs, ...) to ``path`` under the tool's name, the command
    line and :func:`machine`."""
    name = f"tools/{os.path.basename(tool)}"
    command = shlex.join(["python", name, *sys.argv[1:]])
    out = {"tool": name, "command": command, "machine": machine(), **sections}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
