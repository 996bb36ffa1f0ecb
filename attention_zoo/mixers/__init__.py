"""The built-in sequence mixers, one file each (and parts.py, the pieces they share). Importing
this package imports every module in it, which registers the mixers: a new mixer is a new file
here, and no list names it."""
from attention_zoo.plugins import import_package_modules

import_package_modules(__name__, __path__)
