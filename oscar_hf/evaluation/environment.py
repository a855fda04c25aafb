"""What a benchmark row records about where it ran: device, library versions, git commit."""

from __future__ import annotations

import os
import re
import subprocess
from importlib import metadata
from pathlib import Path

import torch
import transformers

GIB = 2**30


def environment(device: torch.device | str, name: str | None = None) -> dict:
    """Device name (``name`` overrides it, e.g. for an interpreter run), its memory in GiB, torch / transformers /
    triton versions and the git commit (``git describe --dirty``; else $GIT_COMMIT, else "unknown")."""
    device = torch.device(device)
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):  # a copy of the tree without .git
        commit = os.environ.get("GIT_COMMIT", "unknown")
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = "not installed"
    cuda = device.type == "cuda"
    return {"gpu": name or (torch.cuda.get_device_name(device) if cuda else "cpu"),
            "gpu_gib": round(torch.cuda.get_device_properties(device).total_memory / GIB, 1) if cuda else None,
            "torch": torch.__version__, "transformers": transformers.__version__, "triton": triton, "commit": commit}


def device_slug(env: dict) -> str:
    """The device name as a file-name part: "NVIDIA H100 80GB HBM3" → "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^A-Za-z0-9]+", "-", env["gpu"]).strip("-").lower()
