"""The conformance command:

    python -m attention_zoo.conformance MODULE [MODULE ...] [--checks=NAME[,NAME...]] [--dry_run]

imports the modules, checks every variant and mixer they register with the conformance suite
(attention_zoo.testing.conformance, which says what it checks), and exits non-zero on any
failure.
"""
import sys

from attention_zoo.testing import conformance

if __name__ == "__main__":
  sys.exit(conformance.main())
