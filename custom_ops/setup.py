"""Prebuild and install blockserve's custom operators (the Dockerfile runs `python setup.py install`):
the CUDA ops (cuda_build.py) on a CUDA build of Paddle, the C++ CPU ops (build.py) otherwise."""

import build
import cuda_build
import paddle
from paddle.utils.cpp_extension import CppExtension, CUDAExtension, setup

if paddle.is_compiled_with_cuda():
    setup(
        name=cuda_build.EXTENSION_NAME,
        ext_modules=CUDAExtension(
            sources=cuda_build.op_sources(),
            include_dirs=[str(cuda_build.SOURCE_DIR)],
            extra_compile_args={"cxx": cuda_build.CXX_FLAGS, "nvcc": cuda_build.nvcc_flags()},
        ),
    )
else:
    setup(
        name=build.EXTENSION_NAME,
        ext_modules=CppExtension(
            sources=build.sources(),
            include_dirs=build.EXTRA_INCLUDE_DIRS,
            extra_compile_args={"cxx": build.CXX_FLAGS},
            extra_link_args=build.EXTRA_LDFLAGS,
        ),
    )
