"""The worker: the model and its paged KV cache, executing the scheduler's steps (on a CPU or a GPU).

process.py (the process and its scheduler link) -> model_runner.py (steps) over the parts startup.py assembles:
models/, layers/, attention/, kernels/, inputs/, sample/, loading/ and host/.
"""
