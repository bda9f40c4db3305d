"""The kernels the model calls (norms, activation, sampling, attention, the fused decoder stack): their Protocol,
the pure-Paddle reference, the C++ CPU and CUDA ops behind it, the choice per device, and building and loading
the ops."""
