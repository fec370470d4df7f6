"""Test and benchmark cases, one module per op family (`cases/<op>.py`): the inputs, shapes,
tolerances and peers that the registry hands to the generic tests and the benchmark harness.

The product (`ops/`) never imports this package; a case module imports its op's public API.
"""
