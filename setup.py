"""Build the native core (`epd_lab._native`) and, where libibverbs headers exist, `epd_lab._verbs`."""
import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

CFLAGS = ["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function"]


def _have_verbs() -> bool:
    """True when <infiniband/verbs.h> is installed (libibverbs-dev)."""
    if os.environ.get("EPD_LAB_NO_VERBS"):
        return False
    return any(os.path.exists(os.path.join(d, "infiniband", "verbs.h")) for d in ("/usr/include", "/usr/local/include"))


extensions = [
    Extension(
        "epd_lab._native",
        sources=["native/_native.pyx", "native/epd_core.c"],
        include_dirs=["native"],
        extra_compile_args=CFLAGS,
    )
]
if _have_verbs():
    extensions.append(
        Extension(
            "epd_lab._verbs",
            sources=["native/_verbs.pyx"],
            include_dirs=["native"],
            libraries=["ibverbs"],
            extra_compile_args=CFLAGS,
        )
    )
    print("epd_lab: building the verbs transport (libibverbs headers found)", file=sys.stderr)
else:
    print(
        "epd_lab: libibverbs headers not found: building without the verbs transport "
        "(apt-get install libibverbs-dev to add it)",
        file=sys.stderr,
    )

setup(ext_modules=cythonize(extensions, language_level=3, compiler_directives={"embedsignature": True}))
