"""Prebuild and install blockserve's custom operators (the Dockerfile runs `python setup.py install`)."""

from build import CXX_FLAGS, EXTENSION_NAME, EXTRA_INCLUDE_DIRS, EXTRA_LDFLAGS, sources
from paddle.utils.cpp_extension import CppExtension, setup

setup(
    name=EXTENSION_NAME,
    ext_modules=CppExtension(
        sources=sources(),
        include_dirs=EXTRA_INCLUDE_DIRS,
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=EXTRA_LDFLAGS,
    ),
)
