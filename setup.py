"""The native part of the build (everything else is in pyproject.toml): the batch page-key
digests of ``flatcake_ray/core/_digests.c`` and the fused copies and block checksums of
``cuda_ext/_copyhash*.c``. Optional: where one cannot be compiled, the package installs without
it and ``core/keys.py`` hashes with hashlib, ``cuda_ext/host_hash.py`` copies and then hashes
(same digests, same sums).
``FLATCAKE_NATIVE=0`` leaves it out: ``make wheel`` does, so the wheel shipped to a cluster's
nodes (``examples/``) stays pure Python and installs on whatever Python their image runs."""

import os

from setuptools import Extension, setup

NATIVE = [
    Extension(
        "flatcake_ray.core._digests",
        ["flatcake_ray/core/_digests.c"],
        extra_compile_args=["-O3"],
        optional=True,
    ),
    Extension(
        "flatcake_ray.cuda_ext._copyhash",
        ["cuda_ext/_copyhash.c", "cuda_ext/_copyhash_pieces.c", "cuda_ext/_copyhash_seal.c"],
        depends=["cuda_ext/_copyhash.h", "cuda_ext/_xxh3_stripes.h"],
        extra_compile_args=["-O3"],
        optional=True,
    ),
]

setup(ext_modules=[] if os.environ.get("FLATCAKE_NATIVE") == "0" else NATIVE)
