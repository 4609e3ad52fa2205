"""What differs between the devices the engine runs on, behind objects the cache, the model and the step loops
ask instead of testing the device type or calling a library themselves.

kernels.py: the device kernels' contract (Kernels: one method per hot spot, the torch reference where a
backend declines) and the table that chooses a backend per device; native_cpu.py (+ native_fused.py): the
CPU's, over the native library; triton_cuda.py: CUDA's, over the Triton kernels (triton_guide.py and
triton_decode.py launch them; their source is triton_code/). streams.py: a device's streams, events, pinned
host memory and graph recording (CUDA's, the CPU's plain synchronous behaviour, and a stand-in that runs CUDA's
orchestration on CPU tensors for the tests); host_mapping.py: the exact store's host memory, which CUDA pins
in place. No module outside this package (and the C build in engine/native) imports Triton, branches on a
CUDA device or hands a tensor's pointer to a library (tests/test_layout.py, tests/test_backends.py)."""
