"""What differs between the devices the engine runs on, behind objects the cache, the model and the step loops
ask instead of testing the device type or calling a library themselves. kernels.py: the device kernels'
contract (Kernels: one method per hot spot, the torch reference when a backend declines) and the table
that chooses a backend per device; native_cpu.py: the CPU's, over the native library."""
