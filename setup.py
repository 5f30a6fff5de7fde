"""Build of tiermem's native core: one plain C shared library loaded with ctypes.

It includes no Python or torch headers and links against neither, so one build serves every
torch version (2.6+) and the library is called on raw pointers. A machine without a C compiler
still installs tiermem: the build is skipped with a warning and tiermem falls back to torch
(``tiermem.optim.cpu_adam`` says so at run time).
"""

import glob
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalNativeBuild(build_ext):
    """Build ``tiermem._tiermem_native`` as a plain shared library; never fail the install."""

    def get_export_symbols(self, ext):
        return []  # no PyInit_*: the library is loaded with ctypes, not imported

    def get_ext_filename(self, ext_name):
        # A fixed name without the CPython ABI tag: the library does not depend on Python's ABI.
        suffix = sysconfig.get_config_var("SHLIB_SUFFIX") or ".so"
        return ext_name.replace(".", "/") + suffix

    def run(self):
        try:
            super().run()
        except Exception as exc:  # compiler missing or broken: install the pure-Python package
            print(f"WARNING: tiermem native core not built ({exc}); torch fallbacks will be used",
                  file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"WARNING: tiermem native core not built ({exc}); torch fallbacks will be used",
                  file=sys.stderr)


native = Extension(
    "tiermem._tiermem_native",
    sources=sorted(glob.glob("native/*.c")),
    include_dirs=["native"],
    extra_compile_args=["-O3", "-std=c11", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                        "-ffp-contract=off",
                        "-fvisibility=hidden", "-Wall"],
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=[native], cmdclass={"build_ext": OptionalNativeBuild})
