# For tools that still look for a setup.py (`python setup.py --version`, older IDEs); the metadata
# is all in pyproject.toml.
from setuptools import setup

setup()
