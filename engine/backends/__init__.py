"""What differs between the devices the engine runs on, behind objects the cache, the model and the step loops
ask instead of testing the device type or calling a library themselves.

kernels.py: the device kernels' contract (Kernels: one method per hot spot, the torch reference where a
backend declines) and the table that chooses a backend per device; native_cpu.py: the CPU's, over the native
library. streams.py: a device's streams, events, pinned host memory and graph recording (CUDA's, the CPU's
plain synchronous behaviour, and a stand-in that runs CUDA's orchestration on CPU tensors for the tests)."""
