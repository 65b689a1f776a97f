"""The one thing pyproject.toml cannot say: the C module of the custom_id table's probes
(``src/backfill/domain/_speedups.c``). It is optional: where it cannot be compiled (no C
compiler or no Python headers) Backfill installs without it and uses the same code in Python,
only slower."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "backfill.domain._speedups",
            ["src/backfill/domain/_speedups.c"],
            optional=True,
        )
    ]
)
