"""The native part of the build (everything else is in pyproject.toml): the batch page-key
digests of ``flatcake_ray/core/_digests.c``. Optional: where it cannot be compiled, the
package installs without it and ``core/keys.py`` hashes with hashlib (same digests)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "flatcake_ray.core._digests",
            ["flatcake_ray/core/_digests.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
