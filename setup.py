"""The one compiled part: shardloader.codecs._jpeg, crop-aware JPEG decoding over the system's
libjpeg-turbo (README "Dependencies").  It is optional: without a C compiler or the libjpeg
headers (Debian: libjpeg62-turbo-dev) the build warns and goes on, and vision decodes through PIL.
Everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shardloader.codecs._jpeg",
            ["shardloader/codecs/_jpeg.c"],
            libraries=["jpeg"],
            optional=True,
        )
    ]
)
