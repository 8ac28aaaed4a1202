"""memplan: activation-memory planning for large transformer training.

The core (specs, inventory, estimate, search) never imports torch; only the
`validation` package does.
"""

__version__ = "0.1.0"
