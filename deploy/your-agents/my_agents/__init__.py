"""Your agents: one module per team or product, each with ``register(registry)``."""
