"""pip entry point: drives the CMake build (CMakeLists.txt lists every source) and installs
libfusedamp, the module fusedamp._C, the C++ headers and the CMake package into the Python
package directory.

Built without build isolation (`pip install --no-build-isolation .`), so that the torch of this
environment is the one built against; the build tools then come from this environment too:
pyproject.toml's [build-system] requires, which pip does not install in that mode. What is
missing is named here, before setuptools fails on it less clearly."""
import hashlib
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_TOOLS = '"setuptools>=64" wheel "cmake>=3.21" ninja'


def _missing_build_tools(msg):
    sys.exit(f"fusedamp: {msg}\nInstall the build tools into this environment first:\n"
             f"    {sys.executable} -m pip install {BUILD_TOOLS}")


def _check_wheel_command():
    # setuptools < 70.1 takes the bdist_wheel command (wheels, and pip's metadata step) from
    # the wheel package; without it the build stops at "invalid command 'bdist_wheel'".
    try:
        from setuptools.command.bdist_wheel import bdist_wheel  # noqa: F401  (setuptools >= 70.1)
        return
    except ImportError:
        pass
    try:
        import wheel  # noqa: F401
    except ImportError:
        import setuptools

        _missing_build_tools(f"setuptools {setuptools.__version__} builds wheels only with the "
                             "'wheel' package, which is not installed.")


def _tool(name):
    """A build tool: this environment's own (e.g. pip's cmake / ninja, whether or not the
    environment is activated), else the PATH's."""
    here = shutil.which(name, path=os.path.dirname(sys.executable))
    return here or shutil.which(name)


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        cmake = _tool("cmake")
        if cmake is None:
            _missing_build_tools("cmake (3.21 or newer) is not installed.")
        try:
            import torch.utils
        except ImportError:
            sys.exit("fusedamp: builds against the torch of the Python that runs pip; install "
                     "torch first, then `pip install --no-build-isolation .`")
        # Directory of the package being built (build/lib*/fusedamp, or python/fusedamp when
        # building in place for an editable install).
        pkg_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        # One build directory per environment: the CMake cache holds the torch it found, and
        # another environment's build must not link the first one's torch.
        env_key = hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:8]
        build_dir = os.path.join(ROOT, "build", f"pip-{sys.implementation.cache_tag}-{env_key}")
        cfg = os.environ.get("CMAKE_BUILD_TYPE", "Release")
        args = [
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DCMAKE_INSTALL_PREFIX={pkg_dir}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            "-DFUSEDAMP_BUILD_PYTHON=ON",
        ]
        ninja = _tool("ninja")
        gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
        if os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            gen = []  # the generator is fixed at the first configure
        subprocess.check_call([cmake, "-S", ROOT, "-B", build_dir, *gen, *args])
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call([cmake, "--build", build_dir, "-j", jobs])
        subprocess.check_call([cmake, "--install", build_dir])


if any(cmd in sys.argv for cmd in ("bdist_wheel", "dist_info", "editable_wheel")):
    _check_wheel_command()

setup(ext_modules=[CMakeExtension("fusedamp._C")], cmdclass={"build_ext": CMakeBuild})
