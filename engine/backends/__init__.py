"""What differs between the devices the engine runs on, behind objects the cache and the step loops ask
instead of testing the device type themselves. streams.py: a device's streams, events, pinned host memory
and graph recording (CUDA's, the CPU's plain synchronous behaviour, and a stand-in that runs CUDA's
orchestration on CPU tensors for the tests)."""
