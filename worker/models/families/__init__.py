"""One module per model family: how its files describe it (models/family.py); models/registry.py lists them."""
