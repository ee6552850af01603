"""Example models built on the library (a small LongNet-style causal LM)."""
