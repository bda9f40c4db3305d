"""The machine the worker runs on: its device and what fits there, moving the model to a GPU, CPU memory and
threads, huge pages, and the device's compute clock."""
