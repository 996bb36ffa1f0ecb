"""attention-zoo: a JAX/Flax zoo of attention mechanisms and the Long Range Arena harness."""
from setuptools import find_packages, setup

# TFDS, for Text / Image without local files; the tests run its readers under TFDS's mock.
TFDS = ["tensorflow-datasets", "tensorflow-cpu"]

setup(
    name="attention-zoo",
    version="0.1.0",
    description=("Attention variants for JAX/Flax NNX, one shared Transformer, and the Long Range "
                 "Arena."),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The libraries. The harness (experiments/, configs/) runs from a checkout, where its
    # commands and config paths live: installed as top-level packages named `experiments`
    # and `configs` it would collide with other projects'.
    packages=find_packages(include=["attention_zoo*", "lra*", "synthetic*"]),
    install_requires=[
        "jax>=0.10",
        "flax>=0.12",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "absl-py",
        "ml-collections",
        "numpy",
        "tqdm",
        "pillow",
        "tensorboardX",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "matplotlib", "ruff", *TFDS],
        "data": TFDS,
        "plots": ["matplotlib"],
    },
)
