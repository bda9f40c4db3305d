"""The error for a model file that cannot be read as what it claims to be."""


class ModelFileError(ValueError):
    """A model file is corrupt or truncated; the message names the file and the field at fault."""
