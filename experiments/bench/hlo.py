"""Whether a compiled program loops over matrix products, read from its HLO text.

XLA's cost analysis counts a while loop's body once, so the FLOPs of a program that scans over
chunks with a matmul in the body are a lower bound. Loops without products (RNG key derivation)
change nothing.
"""
from __future__ import annotations

import re


def loops_over_products(compiled) -> bool:
  """Whether a while loop's body (or what it calls) holds a dot or a convolution."""
  try:
    hlo = compiled.as_text()
  except Exception:   # no HLO text on this backend: say nothing
    return False
  computations, current = {}, None
  for line in hlo.splitlines():
    if line.endswith("{") and not line.startswith(" "):   # "[ENTRY ]%name (args) -> type {"
      current = line.removeprefix("ENTRY ").split()[0].lstrip("%")
      computations[current] = []
    elif current is not None and line.startswith(" "):
      computations[current].append(line)
  calls = {name: {ref for line in lines for ref in re.findall(r"%([\w.\-]+)", line)
                 if ref in computations}
           for name, lines in computations.items()}
  has_product = {name: any(re.search(r"\b(dot|convolution)\(", line) for line in lines)
                 for name, lines in computations.items()}
  todo = [body for lines in computations.values() for line in lines if " while(" in line
          for body in re.findall(r"body=%([\w.\-]+)", line)]
  seen = set()
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    if has_product.get(name):
      return True
    todo.extend(calls.get(name, ()))
  return False
