"""What the tests and the conformance command use: the conformance suite (conformance.py). No
other part of the package imports it."""
