"""Builds the index's native extension; everything else is in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and kvindex uses the
pure-Python twin (kvindex/index/_pytable.py), several times slower.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "kvindex.index._native",
        ["kvindex/index/_native.pyx"],
        extra_compile_args=["-O3"],
        optional=True,
    )
]

setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}, quiet=True))
