"""The built-in attention variants, one file each (and kernelized.py, the machinery performer and
linear_transformer share). Importing this package imports every module in it, which registers
the variants: a new variant is a new file here, and no list names it."""
from attention_zoo.plugins import import_package_modules

import_package_modules(__name__, __path__)
