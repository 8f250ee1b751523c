"""Package discovery, the one thing `pyproject.toml` cannot say (everything else lives there).

`[tool.setuptools.packages.find]` names each package after its folder, but the folder
`kernels/` installs under the import name `draftkernels` (DESIGN 5: a top-level `kernels`
would shadow Hugging Face's hub-kernels library, which transformers probes for). So the
packages are discovered here: every package of the checkout but `tests`, and `kernels/` with
any subpackage it grows, renamed. `tests/jobs/test_packaging.py` builds the wheel and checks that
it holds every package of the source tree, every preset and the zoo.
"""

from setuptools import find_packages, setup

KERNELS_DIR, KERNELS = "kernels", "draftkernels"

setup(
    packages=[
        *find_packages(exclude=["tests", "tests.*"]),
        KERNELS,
        *(f"{KERNELS}.{p}" for p in find_packages(where=KERNELS_DIR)),
    ],
    package_dir={KERNELS: KERNELS_DIR},
)
