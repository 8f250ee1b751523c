"""Package discovery, the one thing `pyproject.toml` cannot say (everything else lives there).

Two top-level folders install under other import names: `kernels/` as `draftkernels` (DESIGN 5:
a top-level `kernels` would shadow Hugging Face's hub-kernels library, which transformers probes
for) and `conf/`, the one home of configuration, as `draftconf` (package data: the Hydra trees
and launcher files, found through the installed package from any directory). setuptools'
`pyproject.toml` table can discover packages (`packages.find`) or list them under other
folders (`package-dir`), not both at once; a static list would make every new kind or family
folder an edit here, against DESIGN 2.1. So the packages are discovered here: every package of
the checkout but `tests` and `conf`, plus the two renamed folders with any subpackage they grow.
`tests/jobs/test_packaging.py` builds the wheel and checks that it holds every package of the
source tree, every config file and the zoo.
"""

from setuptools import find_packages, setup

RENAMED = {"draftkernels": "kernels", "draftconf": "conf"}  # import name -> folder

setup(
    packages=[
        *find_packages(exclude=["tests", "tests.*", *RENAMED.values()]),
        *(
            name
            for pkg, folder in RENAMED.items()
            for name in (pkg, *(f"{pkg}.{p}" for p in find_packages(where=folder)))
        ),
    ],
    package_dir=RENAMED,
)
