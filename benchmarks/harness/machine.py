"""The machine, the code and the moment a result was measured on: every results file names them,
because timings on another CPU, another commit or a loaded machine are other numbers."""
from __future__ import annotations

import datetime as _dt
import hashlib
import os
import platform
import subprocess
from pathlib import Path

import torch

from harness import REPO

# The instruction-set flags a result depends on (the CPU kernels' and torch's paths).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def cpu_model_and_flags() -> tuple[str, set]:
    """The CPU's model name and its instruction-set flags, from /proc/cpuinfo (where there is
    one; the platform's processor name and no flags elsewhere)."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return cpu, flags


def load_average() -> str | None:
    """The 1, 5 and 15 minute load averages: other processes on the cores distort OpenMP
    timings, so a result records how busy the machine was."""
    if not hasattr(os, "getloadavg"):
        return None
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def git(*args, cwd=REPO) -> str:
    """git's output in the checkout (empty where git or the checkout is missing)."""
    try:
        return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def short_commit(cwd=REPO) -> str | None:
    return git("rev-parse", "--short", "HEAD", cwd=cwd) or None


def device_tag(device) -> str:
    """The device part of a results file's name: cpu, or cuda_<gpu model>."""
    if device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip()
    return "cuda_" + "".join(ch if ch.isalnum() else "_" for ch in name).strip("_")


def machine_info(device) -> dict:
    """The machine record of a results file: date, CPU model and flags, threads, torch, the GPU
    where one is used, the fusedamp package that ran and the commit of the tree it was built
    from (marked where csrc/ or cuda/ have uncommitted changes), and the load average."""
    cpu, flags = cpu_model_and_flags()
    info = {"date_utc": now_utc(), "host": platform.node(), "cpu": cpu,
            "cpu_cores": os.cpu_count(), "cpu_flags": [f for f in CPU_FLAGS if f in flags],
            "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": device}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2 ** 30, 1),
                    gpu_sms=p.multi_processor_count)
    try:
        import fusedamp
    except Exception as e:  # a benchmark of other libraries still says where it ran
        info["fusedamp_module"] = f"unavailable ({type(e).__name__}: {e})"[:300]
    else:
        pkg = Path(fusedamp.__file__).resolve().parent
        info["fusedamp_module"] = str(pkg)
        src = pkg.parents[1]  # python/fusedamp → the source tree it was built from
        rev = short_commit(src)
        if rev:
            dirty = git("status", "--porcelain", "--", "csrc", "cuda", "CMakeLists.txt", cwd=src)
            info["fusedamp_commit"] = rev + (" (+ uncommitted csrc/cuda changes)" if dirty
                                             else "")
    load = load_average()
    if load is not None:
        info["load_average_at_start"] = load
    return info


def library_built_utc() -> str | None:
    """When the fusedamp library that runs was built: the commit names the source tree's HEAD,
    and the library may be older than it."""
    import fusedamp
    built = [p.stat().st_mtime for p in Path(fusedamp.__file__).parent.glob("_C*.so")]
    if not built:
        return None
    return _dt.datetime.fromtimestamp(max(built), _dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def working_tree() -> dict:
    """What identifies the code beyond the commit: the tracked files that differ from it and
    the untracked sources of the package and library, with a digest of both (the same working
    tree gives the same digest)."""
    changed = git("diff", "--name-only", "HEAD").splitlines()
    untracked = [f for f in git("ls-files", "--others", "--exclude-standard", "csrc", "python",
                                "cuda").splitlines() if f]
    digest = hashlib.sha256(git("diff", "HEAD").encode())
    for path in untracked:
        digest.update(path.encode() + b"\0" + (REPO / path).read_bytes())
    dirty = changed + [f"{f} (untracked)" for f in untracked]
    return {"commit": short_commit() or "unknown", "uncommitted_changes": dirty,
            "uncommitted_sha256": digest.hexdigest()[:12] if dirty else None}
