"""The ground floor: errors, units (bytes <-> GB / GiB, tokens), symbolic polynomials in s, b, h, ..., arithmetic that
serves scalars and numpy arrays alike, the typed specs (model, parallel plan, training, GPU) and where the torch
harness lies. Imports nothing else of memplan."""
