"""pip entry point: drives the CMake build (CMakeLists.txt lists every source) and installs
libfusedamp, the module fusedamp._C, the C++ headers and the CMake package into the Python
package directory."""
import os
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        # Directory of the package being built (build/lib*/fusedamp, or python/fusedamp when
        # building in place for an editable install).
        pkg_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        build_dir = os.path.join(ROOT, "build", f"pip-{sys.implementation.cache_tag}")
        cfg = os.environ.get("CMAKE_BUILD_TYPE", "Release")
        args = [
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DCMAKE_INSTALL_PREFIX={pkg_dir}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DFUSEDAMP_BUILD_PYTHON=ON",
        ]
        gen = ["-G", "Ninja"] if _have("ninja") else []
        subprocess.check_call(["cmake", "-S", ROOT, "-B", build_dir, *gen, *args])
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", build_dir, "-j", jobs])
        subprocess.check_call(["cmake", "--install", build_dir])


def _have(prog):
    from shutil import which

    return which(prog) is not None


setup(ext_modules=[CMakeExtension("fusedamp._C")], cmdclass={"build_ext": CMakeBuild})
