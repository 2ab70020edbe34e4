"""Builds kvindex's native extensions; everything else is in pyproject.toml.

The extensions are optional: without a C compiler the install still succeeds and kvindex uses the
pure-Python twins (kvindex/index/_pytable.py, the loop in kvindex/keys.py, the frame loop in
kvindex/ingest/direct_dispatch.py, the cost model's row loops run as Python in kvindex/scoring/), several
times slower.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "kvindex.index._native",
        ["kvindex/index/_native.pyx"],
        extra_compile_args=["-O3"],
        optional=True,
    ),
    # The cost model (kvindex/scoring/costs.py, typed by costs.pxd): its Python source compiled, so
    # that the rankings' row loops run natively and every operation rounds as in Python (no fused
    # multiply-add). Without a compiler the same module runs as Python.
    Extension(
        "kvindex.scoring.costs",
        ["kvindex/scoring/costs.py"],
        depends=["kvindex/scoring/costs.pxd"],
        extra_compile_args=["-O3", "-ffp-contract=off"],
        optional=True,
    ),
    Extension(
        "kvindex.scoring._kernels",
        ["kvindex/scoring/_kernels.pyx"],
        depends=["kvindex/_xxh3.h"],
        # No fused multiply-add: the rankings' costs must round as the scalar definitions do
        # (kvindex/scoring/costs.py), so that every form gives bit-identical values.
        extra_compile_args=["-O3", "-ffp-contract=off"],
        optional=True,
    ),
    Extension(
        "kvindex.ingest._frames",
        ["kvindex/ingest/_frames.pyx"],
        extra_compile_args=["-O3"],
        optional=True,
    ),
    # The Lookup RPC's instance list, encoded (kvindex/api/lookup.py has its pure-Python twin).
    Extension(
        "kvindex.api._lookup",
        ["kvindex/api/_lookup.pyx"],
        extra_compile_args=["-O3"],
        optional=True,
    ),
    Extension(
        "kvindex._keys_native",
        ["kvindex/_keys_native.pyx"],
        include_dirs=["kvindex"],
        depends=["kvindex/_xxh3.h"],
        extra_compile_args=["-O3"],
        optional=True,
    ),
]

setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}, quiet=True))
