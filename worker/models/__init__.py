"""Model families (one module each) and the shape of a model (config.py)."""
