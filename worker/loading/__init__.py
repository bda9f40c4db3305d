"""Reading a model: GGUF files and Hugging Face folders, their tokenizers, and the model built from them."""
