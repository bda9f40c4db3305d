"""A step's inputs: per-request state between steps, the flat inputs built from it on the host, the compact delta
sent to the device, and how they reach the model."""
