#!/usr/bin/env python3
"""Fail if any CUDA kernel in a build log spills registers.

The CUDA sources are compiled with -Xptxas=-v (CMakeLists.txt), so for every kernel and
architecture ptxas prints

    ptxas info    : Compiling entry function '<mangled>' for 'sm_90'
    ptxas info    : Function properties for <mangled>
        0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 40 registers, used 1 barriers, 32 bytes smem

Usage: check_spills.py BUILD_LOG [--quiet]   (or '-' for stdin). Prints one line per kernel
(registers, stack, spills, demangled name) unless --quiet; exit status 1 if any kernel spills,
2 if the log holds no ptxas report at all (e.g. nothing was recompiled: touch the .cu files).
"""
import re
import shutil
import subprocess
import sys

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
PROPS = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")


def demangle(names):
    if not names or shutil.which("c++filt") is None:
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) != len(names):
        return {n: n for n in names}
    return dict(zip(names, lines))


def parse(lines):
    """Returns {(mangled, arch): dict(regs, stack, spill_st, spill_ld)}."""
    kernels = {}
    current = None  # (mangled, arch) of the entry whose report is being read
    props_for = None
    for line in lines:
        m = ENTRY.search(line)
        if m:
            current = (m.group(1), m.group(2))
            kernels.setdefault(current, {"regs": None, "stack": 0, "spill_st": 0, "spill_ld": 0})
            props_for = None
            continue
        m = PROPS.search(line)
        if m:
            props_for = m.group(1)
            continue
        m = FRAME.search(line)
        if m and current is not None and props_for == current[0]:
            k = kernels[current]
            k["stack"], k["spill_st"], k["spill_ld"] = (int(g) for g in m.groups())
            continue
        m = USED.search(line)
        if m and current is not None:
            kernels[current]["regs"] = int(m.group(1))
            current = None
    return kernels


def main(argv):
    args = [a for a in argv[1:] if not a.startswith("--")]
    quiet = "--quiet" in argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    src = sys.stdin if args[0] == "-" else open(args[0], errors="replace")
    with src:
        kernels = parse(src)
    if not kernels:
        print("check_spills: no ptxas -v report in the log (were the .cu files compiled?)",
              file=sys.stderr)
        return 2
    names = demangle(sorted({k[0] for k in kernels}))
    bad = 0
    for (mangled, arch), k in sorted(kernels.items(), key=lambda kv: names[kv[0][0]]):
        spills = k["spill_st"] + k["spill_ld"]
        bad += spills > 0
        if not quiet or spills:
            print(f"{'SPILL' if spills else 'ok':5} {arch:7} regs={k['regs']!s:>4} "
                  f"stack={k['stack']:<4} spill_st={k['spill_st']:<4} spill_ld={k['spill_ld']:<4} "
                  f"{names[mangled][:160]}")
    print(f"check_spills: {len(kernels)} kernel builds, {bad} with spills")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
