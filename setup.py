"""The optional native read loop (`detdata.storage._fileread`); everything else is in
pyproject.toml. Without a C compiler the build goes on and detdata reads with its Python
loop (same bytes, same checks; slower with many small shards)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "detdata.storage._fileread",
            ["detdata/storage/_fileread.c"],
            optional=True,
            extra_compile_args=["-O2", "-pthread", "-Wall", "-Wextra", "-Werror=implicit"],
            extra_link_args=["-pthread"],
        )
    ]
)
