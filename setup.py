"""Builds zerofn._C, the pybind11 extension (CPU Adam and friends), without libtorch."""
import glob
import platform

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

compile_args = ["-O3", "-fopenmp", "-ffp-contract=off"]
link_args = ["-fopenmp"]

ext = Pybind11Extension(
    "zerofn._C",
    sorted(glob.glob("cpp/*.cpp")),
    include_dirs=["cpp"],
    cxx_std=17,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
