"""The conformance command:

    python -m attention_zoo.conformance MODULE [MODULE ...] [--checks=NAME[,NAME...]] [--dry_run]

imports the modules, checks every variant and mixer they register with the conformance suite
(attention_zoo.testing.conformance, which says what it checks), and exits non-zero on any
failure. A face only: the suite is attention_zoo.testing.conformance, and no module of the
library imports this one (tests/test_lint.py checks it).
"""
import sys

from attention_zoo.testing import conformance

if __name__ == "__main__":
  sys.exit(conformance.main())
