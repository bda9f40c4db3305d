import os

# Paddle and torch use one thread unless told otherwise.
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
