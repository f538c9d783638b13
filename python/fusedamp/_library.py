"""Loads libfusedamp (the operators) into torch and imports the engine module ``_C``."""
import os

import torch

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))

#: Where ``find_package(fusedamp)`` finds the installed CMake package
#: (``cmake -DCMAKE_PREFIX_PATH=$(python -c 'import fusedamp; print(fusedamp.cmake_prefix_path)')``).
cmake_prefix_path = os.path.join(_PKG_DIR, "share", "cmake")


def _find_library() -> str:
    libdir = os.path.join(_PKG_DIR, "lib")
    names = sorted(os.listdir(libdir)) if os.path.isdir(libdir) else []
    for name in names:
        if name == "libfusedamp.so" or name == "libfusedamp.dylib":
            return os.path.join(libdir, name)
    raise ImportError(
        f"fusedamp: libfusedamp was not found in {libdir}. Build it first: `make build` "
        "(or `pip install .`) from the fusedamp source tree."
    )


library_path = _find_library()
torch.ops.load_library(library_path)

from . import _C  # noqa: E402  (needs the library loaded first)
