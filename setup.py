"""Package layout: the top-level adapters/ folder is installed as ``polykv.adapters``.

A bare top-level ``adapters`` module belongs to an unrelated PyPI library, so the built-in
operator adapters are only ever importable under the ``polykv`` namespace.
"""

from setuptools import find_packages, setup

core = find_packages(include=["polykv", "polykv.*"])
adapters = ["polykv.adapters"] + ["polykv.adapters." + p for p in find_packages(where="adapters")]

setup(
    packages=core + adapters,
    package_dir={"polykv": "polykv", "polykv.adapters": "adapters"},
    package_data={"polykv": ["data/*"]},
)
