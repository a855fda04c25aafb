"""What a benchmark row records about where it ran: device, library versions, git commit, and the GPU's clocks."""

from __future__ import annotations

import os
import re
import subprocess
from importlib import metadata
from pathlib import Path

import torch
import transformers

GIB = 2**30
# nvidia-smi --query-gpu fields of gpu_state, and the bits of NVML's clock-event (throttle) reasons
GPU_STATE = {"sm_mhz": "clocks.sm", "mem_mhz": "clocks.mem", "power_w": "power.draw", "temp_c": "temperature.gpu",
             "clock_events": "clocks_event_reasons.active"}
CLOCK_EVENTS = {0x1: "idle", 0x2: "applications-clocks", 0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x10: "sync-boost",
                0x20: "sw-thermal", 0x40: "hw-thermal", 0x80: "hw-power-brake", 0x100: "display-clocks"}


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


def gpu_state(device: torch.device | str) -> dict:
    """The CUDA device's SM and memory clocks (MHz), power draw (W), temperature (°C) and active clock-event reasons
    (``"none"``, or names joined by ``+``: ``sw-power-cap``, ``hw-thermal``, ...) now, from nvidia-smi. Sampled right
    after a timed run, it tells a GPU that ran slow from a slow kernel. ``{}`` on a CPU, or where nvidia-smi does not
    answer."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    which = f"GPU-{uuid}" if uuid is not None else str(device.index or 0)
    try:
        out = subprocess.run(["nvidia-smi", "-i", which, f"--query-gpu={','.join(GPU_STATE.values())}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_gpu_state(out.stdout)


def parse_gpu_state(line: str) -> dict:
    """gpu_state's dict from nvidia-smi's ``csv,noheader,nounits`` line of the GPU_STATE fields ({} if it is not
    one); a field nvidia-smi cannot read ("[N/A]") is None."""
    values = [v.strip() for v in line.strip().split(",")]
    if len(values) != len(GPU_STATE):
        return {}
    state = {}
    for key, value in zip(GPU_STATE, values):
        try:
            number = int(value, 16) if key == "clock_events" else float(value)
        except ValueError:
            state[key] = None
            continue
        if key == "clock_events":
            state[key] = "+".join(name for bit, name in CLOCK_EVENTS.items() if number & bit) or "none"
        else:
            state[key] = number
    return state


def device_slug(env: dict) -> str:
    """The device name as a file-name part: "NVIDIA H100 80GB HBM3" → "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^A-Za-z0-9]+", "-", env["gpu"]).strip("-").lower()
