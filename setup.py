"""Builds zerofn._C, the pybind11 extension (CPU Adam and friends), without libtorch."""
import glob
import platform

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# -ffp-contract=off: the kernels place every fma themselves, to round like torch.
# -fno-math-errno: sqrt stays one instruction (and vectorises in the generic kernels);
# no -ffast-math, which would fold away the x - x non-finite test.
compile_args = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
link_args = ["-fopenmp"]

# One compiler process per core for the sources (ZEROFN_BUILD_JOBS overrides): the ISA
# kernels are separate files, so a build on a 16-core GPU machine takes a few seconds.
ParallelCompile("ZEROFN_BUILD_JOBS").install()

ext = Pybind11Extension(
    "zerofn._C",
    sorted(glob.glob("cpp/*.cpp")),
    include_dirs=["cpp"],
    cxx_std=17,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
