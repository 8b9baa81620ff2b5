"""Whether torch will see a CUDA device, answered without importing torch where the answer is clear.

``epdserve launch`` decides where its stages go before it starts them, and ``import torch`` (its CUDA libraries
loaded) took seconds of that on the H200 machine (docs/performance.md, "2026-11-28, seventh session"), all before
the first stage started. The driver's own answer is one ``cuInit`` and ``cuDeviceGetCount`` through ``libcuda``
(the CUDA driver API, which honours ``CUDA_VISIBLE_DEVICES`` as torch does); torch's build is in its
``version.py``. Anything unexpected falls back to ``torch.cuda.is_available()``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re


def driver_device_count() -> tuple[int, int] | None:
    """``(devices, driver CUDA version)`` the driver shows this process (the version as ``cuDriverGetVersion``
    gives it: 13000 for 13.0): no devices without a driver library or with ``CUDA_ERROR_NO_DEVICE``; None when the
    driver gives another error (the caller then asks torch)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0, 0  # no driver: no torch build can use CUDA either
    count, version = ctypes.c_int(0), ctypes.c_int(0)
    err = cuda.cuInit(0)
    if err == 100:  # CUDA_ERROR_NO_DEVICE (also what an empty CUDA_VISIBLE_DEVICES gives)
        return 0, 0
    if err != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or cuda.cuDriverGetVersion(
            ctypes.byref(version)) != 0:
        return None
    return count.value, version.value


def torch_cuda_version() -> str | None:
    """The CUDA version the installed torch was built for, read from ``torch/version.py`` without importing torch;
    None for a CPU build, a torch not found, or a file not understood."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as f:
            m = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch when the driver sees no device (False) or sees one
    and torch is a CUDA build of a major version the driver runs (True)."""
    driver = driver_device_count()
    if driver is not None and driver[0] == 0:
        return False
    built_major = (torch_cuda_version() or "").split(".")[0]
    if driver is not None and built_major.isdigit() and driver[1] // 1000 >= int(built_major):
        return True
    import torch

    return torch.cuda.is_available()
