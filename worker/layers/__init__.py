"""The model's building blocks: linear layers and embeddings, rotary embedding, norms, activation, weight formats
and precision, row gathers."""
